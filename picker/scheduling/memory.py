"""What a scorer remembers of where requests went: a bounded map from a key (a session, a band of a prompt's
signature) to the pod that last took one, least recently set forgotten first, a departed pod's entries dropped;
and per pod, an amount of work handed to it that fades as the pod works it off."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
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


class FadingTally:
    """pod address -> an amount (prompt tokens handed to it) that halves every `half_life` seconds.

    Stored as (amount, at): the amount at time `at`, so adding and reading cost one power each. Scorers that read
    every candidate's value in a loop read `entries` (not to be written) and do the arithmetic inline."""

    __slots__ = ("_map", "half_life")

    def __init__(self, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        self.half_life = half_life
        self._map: dict[str, tuple[float, float]] = {}

    @property
    def entries(self) -> Mapping[str, tuple[float, float]]:
        """address -> (amount, at) as last written: the amount now is amount * 0.5 ** ((now - at) / half_life)."""
        return self._map

    def value(self, address: str, now: float) -> float:
        amount, at = self._map.get(address, (0.0, now))
        return amount * 0.5 ** ((now - at) / self.half_life) if amount else 0.0

    def add(self, address: str, amount: float, now: float) -> None:
        at = self._map.get(address, (0.0, now))[1]
        now = max(now, at)  # a peer's pick may be a moment older than our last
        self._map[address] = (self.value(address, now) + amount, now)

    def forget(self, address: str) -> None:
        self._map.pop(address, None)

    def __bool__(self) -> bool:
        return bool(self._map)
