"""What a scorer remembers of where requests went: a bounded map from a key (a session, a band of a prompt's
signature) to the pod that last took one, least recently set forgotten first, a departed pod's entries dropped."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")


class PodMemory(Generic[K]):
    """key -> pod address, at most `capacity` keys."""

    __slots__ = ("_map", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._map: OrderedDict[K, str] = OrderedDict()

    def get(self, key: K) -> str | None:
        return self._map.get(key)

    def remember(self, key: K, address: str) -> None:
        m = self._map
        m[key] = address
        m.move_to_end(key)
        if len(m) > self.capacity:
            m.popitem(last=False)

    def forget_pod(self, address: str) -> None:
        for key in [k for k, a in self._map.items() if a == address]:
            del self._map[key]

    def __len__(self) -> int:
        return len(self._map)
