"""The set of endpoints the picker may route to, changed by discovery and by health, observed by callbacks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from picker.endpoints.state import Endpoint

RemovedCallback = Callable[[Endpoint], None]


class EndpointPool:
    """Endpoints by address. Discovery replaces the address set; removed endpoints notify listeners
    (the prefix index purges them) so state never outlives a pod."""

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._ready: list[Endpoint] = []
        self._on_removed: list[RemovedCallback] = []

    def add_removal_listener(self, callback: RemovedCallback) -> None:
        self._on_removed.append(callback)

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
                merged[addr] = known
        self._endpoints = merged
        self.refresh()
        for endpoint in removed:
            for callback in self._on_removed:
                callback(endpoint)
        return added, removed

    def set_addresses(self, addresses: Iterable[str]) -> tuple[list[Endpoint], list[Endpoint]]:
        return self.set_endpoints(Endpoint.from_address(a) for a in addresses)

    def refresh(self) -> None:
        """Recompute the ready list after a health change (kept precomputed: read on every request)."""
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
