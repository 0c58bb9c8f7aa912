"""The prefix index contract: which endpoint (probably) holds which prefix blocks in its KV cache.

Batch-shaped on purpose — one call per request, whole key chains at a time — so a networked backend
(Redis/Valkey) can serve each call with one round trip (pipeline or script).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol


class CacheRoom(Protocol):
    """Whether a pod's prefix cache has room for one more prefix (what a copy that is not urgent waits for)."""

    def has_room(self, address: str) -> bool:
        """`address` holds fewer blocks than its cache has: caching more there evicts nothing (yet)."""
        ...


class PrefixIndex(CacheRoom, Protocol):
    @property
    def ttl(self) -> float | None:
        """Seconds an entry lives without a refresh (None: until evicted by capacity)."""
        ...

    def match(self, keys: Sequence[int], addresses: Collection[str] | None, now: float) -> dict[str, int]:
        """Longest run of consecutive blocks from keys[0] each endpoint holds (live entries only).

        Only endpoints in `addresses` (all when None) with at least one matched block appear.
        """
        ...

    def record(self, keys: Sequence[int], address: str, now: float, *, prompt_chars: int = 0,
               session_id: str = "") -> None:
        """`address` now holds every block of `keys` (the pick was made): insert or refresh, evict past capacity.

        `prompt_chars` and `session_id` describe the pick for backends that tell other replicas about it.
        """
        ...

    def remove_endpoint(self, address: str) -> None:
        """Forget everything about `address` (it left the pool or its cache was cleared)."""
        ...

    def size(self) -> int:
        """Number of (endpoint, block) entries held."""
        ...

    def set_capacity(self, address: str, blocks: int) -> None:
        """Bound `address`'s entries (its KV cache size in blocks); shrinking evicts the least recently used."""
        ...

    def expire(self, now: float) -> int:
        """Free the entries older than the TTL (matches already ignore them); returns how many went."""
        ...
