"""The set of endpoints the picker may route to. The pool owns every change of it: discovery adds and removes
endpoints, health checks mark them unready, degraded and ready again, and each change is one event to the
listeners (the scheduler purges a departed or unready pod's prefix-index entries, metrics drop a departed pod's
series) and one log line, so no state outlives a pod and no consumer hears of a change by a different path than
another.

A degraded pod is one whose metrics cannot be read while its serving port answers (a wrong metrics port, a
NetworkPolicy, a metrics endpoint too slow under load): it stays routable on what the picker knows itself (its
in-flight counts, the prefix index, its last metrics, stale), because a load signal we cannot read must not turn
into an outage. Only a pod that cannot be reached leaves the ready set."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable

from picker.endpoints.load_column import LoadColumn
from picker.endpoints.state import Endpoint, EndpointState

log = logging.getLogger(__name__)


class PoolEvent(enum.Enum):
    ADDED = "added"  # discovery found it (it starts ready)
    REMOVED = "removed"  # discovery lost it: forget everything about it
    UNREADY = "unready"  # it cannot be reached: not routed to until it recovers
    DEGRADED = "degraded"  # its metrics cannot be read but it answers: routed on our own view of it
    READY = "ready"  # it recovered
    RESTARTED = "restarted"  # its counters started over: it restarted between two scrapes, its cache is empty


PoolListener = Callable[[PoolEvent, Endpoint], None]


class EndpointPool:
    """Endpoints by address, with the ready ones precomputed (read on every request)."""

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._ready: list[Endpoint] = []
        self._loads = LoadColumn()  # the ready pods' in-flight counts and pick times in numpy (large pools' sampling)
        self._listeners: list[PoolListener] = []

    def subscribe(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: PoolEvent, endpoint: Endpoint) -> None:
        for listener in self._listeners:
            listener(event, endpoint)

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
        """Replace the pool with `endpoints` (keeping state of those already known); returns (added, removed)."""
        wanted = {e.address: e for e in endpoints}
        removed = [e for addr, e in self._endpoints.items() if addr not in wanted]
        added: list[Endpoint] = []
        merged: dict[str, Endpoint] = {}
        for addr, endpoint in wanted.items():
            known = self._endpoints.get(addr)
            if known is None:
                added.append(endpoint)
                merged[addr] = endpoint
            else:
                known.name = endpoint.name or known.name
                known.labels = endpoint.labels
                merged[addr] = known
        self._endpoints = merged
        self._refresh()
        for endpoint in removed:
            self._emit(PoolEvent.REMOVED, endpoint)
        for endpoint in added:
            self._emit(PoolEvent.ADDED, endpoint)
        return added, removed

    def mark_unready(self, endpoint: Endpoint, reason: str = "") -> None:
        """Stop routing to `endpoint` (it cannot be reached); no-op when it already is unready or gone."""
        self._transition(endpoint, EndpointState.UNREADY, PoolEvent.UNREADY, reason)

    def mark_degraded(self, endpoint: Endpoint, reason: str = "") -> None:
        """Keep routing to `endpoint` on stale metrics (they cannot be read, the pod answers)."""
        self._transition(endpoint, EndpointState.DEGRADED, PoolEvent.DEGRADED, reason)

    def mark_ready(self, endpoint: Endpoint, reason: str = "") -> None:
        """Route to `endpoint` on fresh metrics again."""
        self._transition(endpoint, EndpointState.READY, PoolEvent.READY, reason)

    def mark_restarted(self, endpoint: Endpoint, reason: str = "") -> None:
        """`endpoint` restarted unseen (between two scrapes: never unready): whatever was known of its cache is gone,
        its state stays."""
        if self._endpoints.get(endpoint.address) is not endpoint:
            return
        log.warning("endpoint %s restarted%s: what it cached is forgotten", endpoint.address,
                    f" ({reason})" if reason else "")
        self._emit(PoolEvent.RESTARTED, endpoint)

    def _transition(self, endpoint: Endpoint, state: EndpointState, event: PoolEvent, reason: str) -> None:
        if endpoint.state is state or self._endpoints.get(endpoint.address) is not endpoint:
            return
        was = endpoint.state
        endpoint.state = state
        self._refresh()
        log.log(logging.INFO if state is EndpointState.READY else logging.WARNING, "endpoint %s %s -> %s%s",
                endpoint.address, was.value, state.value, f": {reason}" if reason else "")
        self._emit(event, endpoint)

    def _refresh(self) -> None:
        self._ready = [e for e in self._endpoints.values() if e.healthy]
        self._loads.track(self._ready)

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def all(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def ready(self) -> list[Endpoint]:
        """Routable endpoints (ready or degraded); the returned list is shared, callers must not mutate it."""
        return self._ready

    def __len__(self) -> int:
        return len(self._endpoints)
