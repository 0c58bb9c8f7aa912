"""The flow controller: a request goes at once while the pool has room and nobody of its
priority or higher waits; otherwise it waits in its band and flow (`queues`) and is dispatched when room frees, or
refused.

- Room: the pool's dispatch level (picker.endpoints.saturation: waiting and KV-cache use against the admission thresholds,
  where a pod's waiting counts the requests we sent it that it has not started yet, and requests dispatched but not
  yet placed count too) below `saturationLimit` for critical requests (priority > 0), below `standardCeiling` of it
  for the others: the room between is held back for critical requests, which then queue behind fewer in the pods. Requests go one at a time: each placement updates the level before
  the next is let through, so room that frees does not release a burst.
- Events, never a polling loop: a request placed or finished, new metrics from a pod, a pod joining. Each runs
  `kick`, which dispatches as many waiters as there is room for, best first.
- Refusals carry the reference picker's reason header: a sheddable request (priority < 0) finds no room -> 429
  `rejected-saturated` at once; its band is full -> 429 `queue_full`; it waited `queueTtl` -> 503
  `rejected-ttl-expired`, both with retry-after. The TTL must stay below Envoy's ext_proc `message_timeout`, or Envoy
  gives up on the stream first (`picker envoy-config` checks the two agree).
- Optional per-flow budgets (`tokensPerMinutePerFlow`): a flow that has used its estimated prompt tokens of the
  last minute gets 429 `token_budget_exceeded` with the seconds until its budget holds the request.
- Fairness between the flows of a band (`fairness`): one turn each (requests), or the flow served the fewest tokens
  first (tokens: each request let through, queued or not, charges its flow `cost`; picker.flowcontrol.queues).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from picker.core.headers import DROPPED_REASON, RETRY_AFTER
from picker.core.requests import CHARS_PER_TOKEN, InferenceRequest, RequestError, estimated_tokens
from picker.endpoints.saturation import SaturationThresholds, dispatch_level
from picker.endpoints.state import Endpoint
from picker.flowcontrol.queues import Fairness, FlowQueues, QueueFull, Waiter
from picker.flowcontrol.slots import RunningSlots

DEFAULT_FLOW = "default"  # the flow of requests that name no fairness id


@dataclass(frozen=True, slots=True)
class FlowSettings:
    queue_ttl: float = 4.0
    max_requests_per_band: int = 1000
    max_tokens_per_band: int = 4_000_000
    saturation_limit: float = 1.0
    # Standard and sheddable requests (priority <= 0) are let through only below this share of the limit: the
    # room above it is held back for critical ones, so a critical request finds the pods' queues short.
    standard_ceiling: float = 1.0
    retry_after: str = "1"
    chars_per_token: int = CHARS_PER_TOKEN
    tokens_per_minute_per_flow: int = 0  # a flow's budget of estimated prompt tokens (0: none)
    # This share of the pool's running slots is kept free for critical requests (0: none), so one starts at once
    # instead of queueing inside a pod behind a full batch; critical requests, too, wait here, not in a pod.
    critical_slot_share: float = 0.0
    max_running_per_pod: int = 0  # the pods' capacity (vLLM --max-num-seqs); 0: learned from their metrics
    # Who goes first among a band's flows: "requests" (round-robin) or "tokens" (the flow served the fewest tokens:
    # prompt tokens, plus `output_token_weight` per output token a request asks for at most, its max_tokens)
    fairness: Fairness = "requests"
    output_token_weight: float = 2.0  # an output token costs a pod more than a prompt token (the VTC paper's 2)


class FlowObserver(Protocol):
    """Where the controller reports what happened to each request (the picker's Prometheus metrics)."""

    def observe_flow(self, request: InferenceRequest, outcome: str, waited_s: float) -> None:
        """`outcome`: Dispatched, RejectedCapacity, EvictedTTL or EvictedContextCancelled."""
        ...

    def observe_dispatch_cycle(self, seconds: float) -> None:
        ...

    def observe_enqueue(self, request: InferenceRequest, outcome: str, seconds: float) -> None:
        """Time taken to queue a request (`outcome`: Enqueued or RejectedCapacity)."""
        ...

    def observe_charge(self, request: InferenceRequest, tokens: float) -> None:
        """Token fairness charged `request`'s flow `tokens` as it was let through."""
        ...


class TokenBudgets:
    """Each flow's tokens-per-minute budget as a bucket: full at the start, refilled continuously, a request
    taking its estimated prompt tokens; a flow without enough left is refused with the wait until it has. The
    first `max_flows` flows seen are tracked; the least recently used one makes room for a new one."""

    def __init__(self, per_minute: int, max_flows: int = 10_000) -> None:
        self.per_minute = per_minute
        self.max_flows = max_flows
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # flow -> (tokens left, as of)

    def take(self, flow: str, tokens: int, now: float) -> float:
        """Take `tokens` from `flow`'s bucket: 0 when taken, else the seconds until it would hold them."""
        capacity, rate = float(self.per_minute), self.per_minute / 60.0
        left, then = self._buckets.pop(flow, (capacity, now))
        left = min(capacity, left + (now - then) * rate)
        need = min(float(tokens), capacity)  # a prompt larger than a minute's budget waits for a full bucket
        wait = 0.0 if left >= need else (need - left) / rate
        self._buckets[flow] = (left - need if not wait else left, now)
        if len(self._buckets) > self.max_flows:
            self._buckets.popitem(last=False)
        return wait


class _Ticket:
    """What a waiter holds: its request, how to let it go, whether it was let go."""

    __slots__ = ("request", "go", "dispatched")

    def __init__(self, request: InferenceRequest, go: Callable[[], bool]) -> None:
        self.request = request
        self.go = go  # lets the request through; False when its client has left meanwhile
        self.dispatched = False


class FlowController:
    """Admits, queues and dispatches requests; `kick` whenever room may have freed.

    One of the director's gates (picker.routing.admission.Gate): its decisions are synchronous (`offer`, `kick`, `expire`,
    `withdraw`: every time read from `clock`), so the benchmark's fast mode runs them in simulated time."""

    def __init__(self, settings: FlowSettings, thresholds: SaturationThresholds,
                 pool: Callable[[], Sequence[Endpoint]], clock: Callable[[], float] = time.monotonic,
                 observer: FlowObserver | None = None) -> None:
        self.settings = settings
        self.thresholds = thresholds
        self.pool = pool  # the ready endpoints (the gate looks at the pool, not a request's subset hint)
        self.clock = clock
        self.observer = observer
        self.queues: FlowQueues[_Ticket] = FlowQueues(settings.max_requests_per_band, settings.max_tokens_per_band,
                                                      settings.fairness)
        self.budgets = TokenBudgets(settings.tokens_per_minute_per_flow) if settings.tokens_per_minute_per_flow else None
        self.unplaced = 0  # dispatched, not yet placed on a pod: load the pool's metrics cannot show yet
        # Replicas sharing their load (picker.endpoints.shared_load) see each other's requests only at each sync;
        # until the next, each of the `peers` is taken to let through as many as we did since the last one.
        self.peers = 0
        self.since_sync = 0
        self.slots = RunningSlots(settings.max_running_per_pod)

    def level(self, now: float, pods: Sequence[Endpoint] | None = None) -> float:
        return dispatch_level(self.pool() if pods is None else pods, now, self.thresholds, self._pending())

    def _pending(self) -> int:
        """Requests let through that the pods' counts do not show yet: ours not yet placed, and what the other
        replicas are taken to have let through since the last sync."""
        return self.unplaced + self.since_sync * self.peers

    def ceiling(self, priority: int) -> float:
        """The level below which requests of `priority` are let through."""
        limit = self.settings.saturation_limit
        return limit if priority > 0 else limit * self.settings.standard_ceiling

    def has_room(self, now: float, priority: int = 1) -> bool:
        pods = self.pool()
        if self.level(now, pods) >= self.ceiling(priority):
            return False
        share = self.settings.critical_slot_share
        if not share:
            return True
        slots = self.slots.free(pods, self._pending())
        if slots is None:  # some pod's capacity not known yet: nothing to hold back
            return True
        free, total = slots
        return free > (0 if priority > 0 else math.ceil(share * total))

    def with_room(self, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Where a request let through may go: with slots held back, the candidates with a free slot (a request
        let through for a free slot must not queue in a full pod); all of them when none has one or capacities are
        unknown."""
        if not self.settings.critical_slot_share:
            return candidates
        return self.slots.open_on(candidates) or candidates

    def load_synced(self, peers: int) -> None:
        """The pods' in-flight counts include the other replicas' as of now (`Gate.load_synced`)."""
        self.peers = peers
        self.since_sync = 0
        self.kick()

    def pod_refreshed(self, endpoint: Endpoint) -> None:
        """A pod's metrics were refreshed: learn its capacity (when slots are held back); room may have freed."""
        if self.settings.critical_slot_share:
            self.slots.observe(endpoint)
            self.slots.forget_absent(self.pool())
        self.kick()

    def refusal(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> RequestError | None:
        """The refusal a sheddable request gets at once when the pool has no room (its flow's token budget is not
        read: Explain must not spend it)."""
        if request.priority >= 0 or self._may_go(now, request.priority):
            return None
        return self._shed(request.priority)

    def weighs(self, request: InferenceRequest) -> dict[str, float]:
        """Under fairness by tokens: what letting `request` through would charge its flow, and what its flow has
        been charged (the least-charged waiting flow goes first)."""
        if not self.queues.by_tokens:
            return {}
        return {"flow_cost_tokens": self.cost(request),
                "flow_charged_tokens": self.queues.charged(request.fairness_id or DEFAULT_FLOW)}

    def _may_go(self, now: float, priority: int) -> bool:
        """Nobody of this priority or higher waits, and the pool has room for it."""
        return not self.queues.has_waiting_at_or_above(priority) and self.has_room(now, priority)

    def _shed(self, priority: int) -> RequestError:
        return self._refusal(429, "saturated", "rejected-saturated", f"the pool has no room; request priority "
                             f"{priority} is sheddable")

    def offer(self, request: InferenceRequest, candidates: Sequence[Endpoint],
              go: Callable[[], bool]) -> Waiter[_Ticket] | None:
        """Admit `request` (its priority resolved; the gate looks at the pool, not at its `candidates`): None when
        it may be placed now (the caller then calls `placed`); else its place in the queue, and `go` is called
        when `kick` lets it through (the caller then places it and calls `placed`), or `expire` refuses it once
        its TTL has passed. RequestError when refused at once."""
        now = self.clock()
        priority = request.priority
        if self.budgets is not None:
            wait = self.budgets.take(request.fairness_id or DEFAULT_FLOW,
                                     estimated_tokens(request, self.settings.chars_per_token), now)
            if wait:
                self._observe(request, "RejectedCapacity", 0.0)
                raise RequestError(429, "token_budget_exceeded", f"flow {request.fairness_id or DEFAULT_FLOW!r} has "
                                   f"used its {self.settings.tokens_per_minute_per_flow} tokens per minute",
                                   headers={RETRY_AFTER: str(max(1, math.ceil(wait))),
                                            DROPPED_REASON: "rejected-token-budget"})
        if self._may_go(now, priority):
            self._let_through(request, 0.0)
            return None
        if priority < 0:
            self._observe(request, "RejectedCapacity", 0.0)
            raise self._shed(priority)
        began = time.perf_counter()
        try:
            waiter = self.queues.push(_Ticket(request, go), priority=priority,
                                      flow=request.fairness_id or DEFAULT_FLOW,
                                      tokens=estimated_tokens(request, self.settings.chars_per_token),
                                      size_bytes=request.body_bytes, now=now, ttl=self.settings.queue_ttl)
        except QueueFull as exc:
            self._observe(request, "RejectedCapacity", 0.0)
            if self.observer is not None:
                self.observer.observe_enqueue(request, "RejectedCapacity", time.perf_counter() - began)
            raise self._refusal(429, "queue_full", "rejected-saturated", f"the queue is full: {exc}") from None
        if self.observer is not None:
            self.observer.observe_enqueue(request, "Enqueued", time.perf_counter() - began)
        self.kick()
        return waiter

    def withdraw(self, waiter: Waiter[_Ticket]) -> None:
        """The client of a queued or let-through (not yet placed) request has left."""
        if waiter.item.dispatched:
            self.unplaced -= 1
            self.kick()
        elif self.queues.remove(waiter):
            self._observe(waiter.item.request, "EvictedContextCancelled", self.clock() - waiter.enqueued_at)

    def expire(self, waiter: Waiter[_Ticket]) -> RequestError | None:
        """The waiter's TTL has passed: withdraw it and return its 503; None when it is gone already."""
        if not self.queues.remove(waiter):
            return None
        waited = self.clock() - waiter.enqueued_at
        self._observe(waiter.item.request, "EvictedTTL", waited)
        return self._refusal(503, "queue_ttl_expired", "rejected-ttl-expired",
                             f"no room in the pool within the queue TTL ({self.settings.queue_ttl:g}s, "
                             f"waited {waited:.2f}s)")

    def placed(self) -> None:
        """A dispatched request is on a pod now (its in-flight count shows it): let the next one through."""
        self.unplaced = max(0, self.unplaced - 1)
        self.kick()

    def kick(self) -> None:
        """Room may have freed: dispatch waiters, best first, while there is room."""
        if not len(self.queues):
            return
        began = time.perf_counter()
        now = self.clock()
        while (head := self.queues.peek()) is not None and self.has_room(now, head.priority):
            waiter = self.queues.pop()
            if waiter is None:
                break
            ticket = waiter.item
            if not ticket.go():
                continue
            ticket.dispatched = True
            self._let_through(ticket.request, now - waiter.enqueued_at)
        if self.observer is not None:
            self.observer.observe_dispatch_cycle(time.perf_counter() - began)

    def _let_through(self, request: InferenceRequest, waited: float) -> None:
        """A request goes to be placed: not on a pod yet, one more let through since the last load sync, and its
        flow charged what it costs (token fairness)."""
        self.unplaced += 1
        self.since_sync += 1
        if self.queues.by_tokens:
            tokens = self.cost(request)
            self.queues.charge(request.fairness_id or DEFAULT_FLOW, tokens)
            if self.observer is not None:
                self.observer.observe_charge(request, tokens)
        self._observe(request, "Dispatched", waited)

    def cost(self, request: InferenceRequest) -> float:
        """What a request costs its flow under token fairness: its prompt tokens and, weighed, the output tokens it
        asks for at most (the output it will really produce is known only after the response), as the in-flight
        estimate counts them (`estimated_tokens`: prompt plus capped output)."""
        prompt_and_output = estimated_tokens(request, self.settings.chars_per_token)
        output = prompt_and_output - len(request.prompt_text) // self.settings.chars_per_token
        return prompt_and_output + (self.settings.output_token_weight - 1) * output

    def _refusal(self, status: int, code: str, reason: str, message: str) -> RequestError:
        return RequestError(status, code, message,
                            headers={RETRY_AFTER: self.settings.retry_after, DROPPED_REASON: reason})

    def _observe(self, request: InferenceRequest, outcome: str, waited: float) -> None:
        if self.observer is not None:
            self.observer.observe_flow(request, outcome, waited)

    def waiting(self) -> list[InferenceRequest]:
        """The queued requests, best first within each band (metrics read it at scrape time)."""
        return [w.item.request for w in self.queues.waiters()]
