"""Running slots: how many requests each pod can run at once, and how many of those are free.

A request let through to a pod whose running batch is full waits in the pod's queue, first come first served,
whatever its priority: under overload a critical request then waits behind a whole batch (seconds). Holding some
slots free for critical requests lets one start at once. A pod's capacity is vLLM's `--max-num-seqs` (or less,
when its KV cache runs out first); no metric says it, so it is configured (`maxRunningPerPod`) or learned: the
most requests the pod has been seen running, counted once it has shown a queue (requests waiting means it ran
all it could). Until every pod's capacity is known, no slot is held back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from picker.endpoints.state import Endpoint

MAX_REMEMBERED = 4096  # learned capacities of pods that left are dropped past this many


class RunningSlots:
    __slots__ = ("per_pod", "_most", "_queued", "_finished_then")

    def __init__(self, per_pod: int = 0) -> None:
        self.per_pod = per_pod  # configured capacity of every pod; 0: learn each one's
        self._most: dict[str, int] = {}  # address -> most requests seen running
        self._queued: set[str] = set()  # pods seen with requests waiting: their most is their capacity
        self._finished_then: dict[str, int] = {}  # address -> its `finished` count at its last scrape

    def observe(self, endpoint: Endpoint) -> None:
        """A pod's metrics were refreshed: learn from what it runs. The most it has run counts, not what it ran
        when the queue showed: a scrape can catch a pod between finishing a request and starting the next."""
        m, address = endpoint.metrics, endpoint.address
        self._finished_then[address] = endpoint.finished
        if self.per_pod:
            return
        if m.running > self._most.get(address, 0):
            self._most[address] = int(m.running)
        if m.waiting > 0 and address in self._most:
            self._queued.add(address)

    def forget_absent(self, present: Sequence[Endpoint]) -> None:
        """Past MAX_REMEMBERED pods, drop the ones no longer `present`."""
        if len(self._most) > MAX_REMEMBERED:
            keep = {e.address for e in present}
            self._most = {a: c for a, c in self._most.items() if a in keep}
            self._queued &= keep
            self._finished_then = {a: n for a, n in self._finished_then.items() if a in keep}

    def capacity(self, endpoint: Endpoint) -> int | None:
        if self.per_pod:
            return self.per_pod
        return self._most[endpoint.address] if endpoint.address in self._queued else None

    def open_on(self, pods: Sequence[Endpoint]) -> list[Endpoint] | None:
        """The pods with a free slot, in order; None while some pod's capacity is unknown."""
        out = []
        for e in pods:
            capacity = self.capacity(e)
            if capacity is None:
                return None
            if self._use(e) < capacity:
                out.append(e)
        return out

    def _use(self, e: Endpoint) -> int:
        m = e.metrics
        reported = math.ceil(m.running + m.waiting) - (e.finished - self._finished_then.get(e.address, e.finished))
        return max(reported, e.fleet_in_flight)

    def free(self, pods: Sequence[Endpoint], pending: int) -> tuple[int, int] | None:
        """(free slots, all slots) over `pods`, the `pending` requests let through and not yet placed taking
        free ones; None while some pod's capacity is unknown. A pod's use is what it reported running and
        waiting less what we have seen end since, or what we sent it and has not ended, whichever is more (a
        scrape lags both our sends and the ends: counted busy until the next one, a slot would sit idle)."""
        free = total = 0
        for e in pods:
            capacity = self.capacity(e)
            if capacity is None:
                return None
            total += capacity
            free += max(0, capacity - self._use(e))
        return free - pending, total
