"""Who waits and who goes next: strict priority between bands, round-robin between the flows (tenants) of a band,
first come first served inside a flow. Bounded per band by requests and by prompt tokens.

Round-robin by request, not by tokens served: the picker knows a request's size only by its prompt estimate when it
queues it, and what it costs a pod (its output) only after the response, which buffered Envoy never shows; one
turn per flow already gives each backlogged tenant the same share of dispatches however much each offers.

Pure and synchronous: every time is an argument, so tests drive it on an injected clock and the simulator in
simulated time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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


class FlowQueues(Generic[T]):
    """The waiting requests of every band; `pop` takes the next to dispatch."""

    def __init__(self, max_requests_per_band: int, max_tokens_per_band: int) -> None:
        if max_requests_per_band <= 0 or max_tokens_per_band <= 0:
            raise ValueError("band limits must be positive")
        self.max_requests = max_requests_per_band
        self.max_tokens = max_tokens_per_band
        self._bands: dict[int, Band] = {}
        self._order: list[int] = []  # priorities with a band, highest first
        self.length = 0

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
        """The next to dispatch, without taking it: the highest band with waiters, its flow whose turn it is."""
        for priority in self._order:
            band = self._bands[priority]
            if band.length:
                flow = next(iter(band.turns))
                return band.flows[flow][0]
        return None

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
