"""Who waits and who goes next: strict priority between bands, then between the flows (tenants) of a band either
round-robin (`fairness="requests"`, the default: one turn per backlogged flow) or by tokens (`"tokens"`: the
backlogged flow that has been served the fewest tokens goes first), first come first served inside a flow.
Bounded per band by requests and by prompt tokens.

By requests, a tenant sending 8k-token prompts gets the same share of dispatches as one sending 200-token prompts,
so it takes forty times the pods' work. By tokens (the virtual token counter of "Fairness in Serving Large Language
Models", OSDI 2024): every request let through charges its flow what it costs (`charge`: its prompt tokens, and its
output as far as it is known in advance); a flow that starts waiting is lifted to the least counter of the flows
already waiting (or of the last one served), so a tenant cannot bank credit while idle and spend it in a burst.

Pure and synchronous: every time is an argument, so tests drive it on an injected clock and the simulator in
simulated time.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Waiter(Generic[T]):
    """One queued request: its band and flow, what it weighs, when it came and when it must be gone."""

    item: T
    priority: int
    flow: str
    tokens: int
    size_bytes: int
    enqueued_at: float
    deadline: float
    queued: bool = True  # False once dispatched, expired or withdrawn


@dataclass(slots=True)
class Band:
    """The waiters of one priority: a FIFO per flow, and the flows with a backlog in their round-robin order."""

    priority: int
    flows: dict[str, deque[Waiter]] = field(default_factory=dict)  # type: ignore[type-arg]
    turns: OrderedDict[str, None] = field(default_factory=OrderedDict)  # backlogged flows, next turn first
    length: int = 0
    tokens: int = 0
    size_bytes: int = 0


class QueueFull(Exception):
    """The band holds its limit of requests or prompt tokens."""


Fairness = Literal["requests", "tokens"]
FAIRNESS: tuple[Fairness, ...] = ("requests", "tokens")


class FlowQueues(Generic[T]):
    """The waiting requests of every band; `pop` takes the next to dispatch."""

    def __init__(self, max_requests_per_band: int, max_tokens_per_band: int, fairness: Fairness = "requests",
                 max_flows: int = 10_000) -> None:
        if max_requests_per_band <= 0 or max_tokens_per_band <= 0:
            raise ValueError("band limits must be positive")
        if fairness not in FAIRNESS:
            raise ValueError(f"fairness {fairness!r}: one of {', '.join(FAIRNESS)}")
        self.max_requests = max_requests_per_band
        self.max_tokens = max_tokens_per_band
        self.by_tokens = fairness == "tokens"
        self._bands: dict[int, Band] = {}
        self._order: list[int] = []  # priorities with a band, highest first
        self.length = 0
        # by tokens: each flow's tokens served (its virtual counter), least recently charged first, `max_flows` kept
        self.served: OrderedDict[str, float] = OrderedDict()
        self._max_flows = max_flows
        self._floor = 0.0  # the counter of the flow served last: where a flow that starts waiting alone begins

    def __len__(self) -> int:
        return self.length

    def push(self, item: T, *, priority: int, flow: str, tokens: int, size_bytes: int, now: float,
             ttl: float) -> Waiter[T]:
        """Queue `item`; QueueFull when its band is at a limit (a lone request larger than the token limit still
        queues in an empty band: the limit bounds memory, it must not refuse a request forever)."""
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = Band(priority)
            self._order = sorted(self._bands, reverse=True)
        if band.length >= self.max_requests or (band.length and band.tokens + tokens > self.max_tokens):
            raise QueueFull(f"priority {priority} holds {band.length} requests and {band.tokens} prompt tokens")
        waiter = Waiter(item, priority, flow, tokens, size_bytes, now, now + ttl)
        queue = band.flows.get(flow)
        if queue is None:
            queue = band.flows[flow] = deque()
        if not queue:
            if self.by_tokens:
                self._lift(flow)
            band.turns[flow] = None
        queue.append(waiter)
        band.length += 1
        band.tokens += tokens
        band.size_bytes += size_bytes
        self.length += 1
        return waiter

    def has_waiting_at_or_above(self, priority: int) -> bool:
        """Whether a request of `priority` or higher waits (a newcomer of `priority` must queue behind it)."""
        return any(p >= priority and self._bands[p].length for p in self._order)

    def peek(self) -> Waiter[T] | None:
        """The next to dispatch, without taking it: the highest band with waiters, its flow whose turn it is (by
        tokens: the one served least, the round's order breaking ties)."""
        for priority in self._order:
            band = self._bands[priority]
            if band.length:
                if self.by_tokens:
                    served = self.served
                    flow = min(band.turns, key=lambda f: served.get(f, 0.0))
                else:
                    flow = next(iter(band.turns))
                return band.flows[flow][0]
        return None

    def charged(self, flow: str) -> float:
        """`flow`'s counter (tokens charged, lifted as it started waiting), or where a new flow would start."""
        return self.served.get(flow, self._floor)

    def charge(self, flow: str, tokens: float) -> None:
        """A request of `flow` was let through (queued or not) and costs `tokens` (fairness by tokens)."""
        served = self.served.pop(flow, self._floor) + tokens
        self.served[flow] = served
        self._floor = served
        if len(self.served) > self._max_flows:
            self.served.popitem(last=False)

    def _lift(self, flow: str) -> None:
        """`flow` starts waiting: no lower than the least counter of the flows already waiting (of any band), or
        than the last served when none waits."""
        waiting = [self.served.get(f, 0.0) for band in self._bands.values() for f in band.turns]
        floor = min(waiting) if waiting else self._floor
        if self.served.get(flow, -math.inf) < floor:
            self.served[flow] = floor

    def pop(self) -> Waiter[T] | None:
        """Take the next to dispatch; its flow's turn passes to the next backlogged flow of the band."""
        waiter = self.peek()
        if waiter is None:
            return None
        band = self._bands[waiter.priority]
        queue = band.flows[waiter.flow]
        queue.popleft()
        del band.turns[waiter.flow]
        if queue:
            band.turns[waiter.flow] = None  # back of the round
        else:
            del band.flows[waiter.flow]
        self._left(band, waiter)
        return waiter

    def remove(self, waiter: Waiter[T]) -> bool:
        """Withdraw a waiter (its TTL passed, its client left); False when it is no longer queued."""
        if not waiter.queued:
            return False
        band = self._bands[waiter.priority]
        queue = band.flows[waiter.flow]
        queue.remove(waiter)
        if not queue:
            del band.flows[waiter.flow]
            del band.turns[waiter.flow]
        self._left(band, waiter)
        return True

    def _left(self, band: Band, waiter: Waiter[T]) -> None:
        waiter.queued = False
        band.length -= 1
        band.tokens -= waiter.tokens
        band.size_bytes -= waiter.size_bytes
        self.length -= 1
        if not band.length:
            del self._bands[band.priority]
            self._order = sorted(self._bands, reverse=True)

    def expired(self, now: float) -> list[Waiter[T]]:
        """Withdraw and return every waiter whose deadline has passed."""
        gone = [w for w in self.waiters() if w.deadline <= now]
        for waiter in gone:
            self.remove(waiter)
        return gone

    def waiters(self) -> Iterator[Waiter[T]]:
        for priority in list(self._order):
            for queue in list(self._bands[priority].flows.values()):
                yield from list(queue)

    def band_usage(self) -> dict[int, tuple[int, int, int]]:
        """priority -> (requests, prompt tokens, body bytes) waiting."""
        return {p: (b.length, b.tokens, b.size_bytes) for p, b in self._bands.items()}
