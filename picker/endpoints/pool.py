"""The set of endpoints the picker may route to. The pool owns every change of it: discovery adds and removes
endpoints, health checks mark them unready and ready again, and each change is one event to the listeners
(the scheduler purges a departed or unready pod's prefix-index entries, metrics drop a departed pod's series),
so no state outlives a pod and no consumer hears of a change by a different path than another."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

from picker.endpoints.state import Endpoint


class PoolEvent(enum.Enum):
    ADDED = "added"  # discovery found it (it starts ready)
    REMOVED = "removed"  # discovery lost it: forget everything about it
    UNREADY = "unready"  # it failed its health checks: not routed to until it recovers
    READY = "ready"  # it recovered


PoolListener = Callable[[PoolEvent, Endpoint], None]


class EndpointPool:
    """Endpoints by address, with the ready ones precomputed (read on every request)."""

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._ready: list[Endpoint] = []
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

    def set_addresses(self, addresses: Iterable[str]) -> tuple[list[Endpoint], list[Endpoint]]:
        return self.set_endpoints(Endpoint.from_address(a) for a in addresses)

    def mark_unready(self, endpoint: Endpoint) -> None:
        """Stop routing to `endpoint` (its health checks fail); no-op when it already is unready or gone."""
        if endpoint.healthy and self._endpoints.get(endpoint.address) is endpoint:
            endpoint.healthy = False
            self._refresh()
            self._emit(PoolEvent.UNREADY, endpoint)

    def mark_ready(self, endpoint: Endpoint) -> None:
        """Route to `endpoint` again (it answers its health checks)."""
        if not endpoint.healthy and self._endpoints.get(endpoint.address) is endpoint:
            endpoint.healthy = True
            self._refresh()
            self._emit(PoolEvent.READY, endpoint)

    def _refresh(self) -> None:
        self._ready = [e for e in self._endpoints.values() if e.healthy]

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def all(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def ready(self) -> list[Endpoint]:
        """Healthy endpoints; the returned list is shared, callers must not mutate it."""
        return self._ready

    def __len__(self) -> int:
        return len(self._endpoints)
