"""In-process prefix index: per-endpoint LRU of block keys, bounded like the pod's KV cache, with TTL.

Because keys are chained, key i only ever appears at position i; a match can only start on the holders of
keys[0]. So the reverse map (key -> endpoints) is kept for first blocks only, and matching binary-searches
each holder's own LRU. Keys must be chains from `prefix_keys` (a key determines all keys before it). That keeps memory to one LRU slot per (endpoint, block) plus a small first-block map.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

DEFAULT_CAPACITY_BLOCKS = 31_250  # GIE's per-server LRU size when the pod's block count is unknown
DEFAULT_TTL_SECONDS = 600.0


class InMemoryPrefixIndex:
    """Implements `PrefixIndex` in memory. Not thread-safe: the asyncio loop owns it."""

    def __init__(
        self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS, ttl: float | None = DEFAULT_TTL_SECONDS
    ) -> None:
        if default_capacity <= 0:
            raise ValueError("default_capacity must be positive")
        if ttl is not None and ttl <= 0:
            raise ValueError("ttl must be positive or None")
        self.default_capacity = default_capacity
        self.ttl = ttl
        # address -> OrderedDict[key, last recorded time], least recently recorded first.
        self._lru: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}
        # first-block key -> addresses holding it (chain starts only).
        self._roots: dict[int, set[str]] = {}

    def match(self, keys: Sequence[int], addresses: Collection[str] | None, now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        if not keys:
            return out
        holders = self._roots.get(keys[0])
        if not holders:
            return out
        cutoff = None if self.ttl is None else now - self.ttl
        for address in holders:
            if addresses is not None and address not in addresses:
                continue
            # Held blocks of a chain form a prefix (see `record`), so binary-search the last held one:
            # O(log n) lookups per holder instead of walking up to 256 keys.
            get = self._lru[address].get
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                t = get(keys[mid - 1])
                if t is not None and (cutoff is None or t >= cutoff):
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                out[address] = lo
        return out

    def record(self, keys: Sequence[int], address: str, now: float, *, prompt_chars: int = 0,
               session_id: str = "", never_older: bool = False) -> None:
        """`never_older`: keep a newer time already held (picks from other replicas may arrive a moment late;
        a parent must never end up older than its child, or `match`'s binary search breaks)."""
        if not keys:
            return
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = OrderedDict()
        root = keys[0]
        if root not in lru:
            self._roots.setdefault(root, set()).add(address)
        move = lru.move_to_end
        # Leaf first, root last. Key i-1 (the parent, fixed by key i since keys are chained) is then always
        # more recent and no older than key i, so LRU and TTL evict chains from the tail (as vLLM frees
        # blocks) and each endpoint's blocks of any chain form a prefix: what makes `match` a binary search.
        if never_older:
            get = lru.get
            for key in reversed(keys):
                held = get(key)
                lru[key] = now if held is None or held < now else held
                move(key)
        else:
            for key in reversed(keys):
                lru[key] = now  # appends a new key, updates an old one in place ...
                move(key)  # ... which this then makes the most recent
        self._evict(address, lru, now)

    def _evict(self, address: str, lru: OrderedDict[int, float], now: float | None) -> None:
        """Drop entries past capacity, and expired ones at the old end (records arrive in time order)."""
        capacity = self._capacity.get(address, self.default_capacity)
        roots = self._roots
        cutoff = None if (self.ttl is None or now is None) else now - self.ttl
        while lru:
            if len(lru) <= capacity:
                if cutoff is None:
                    break
                oldest = next(iter(lru.values()))
                if oldest >= cutoff:
                    break
            key, _ = lru.popitem(last=False)
            holders = roots.get(key)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del roots[key]

    def expire(self, now: float) -> int:
        """Sweep expired entries everywhere (matches already ignore them; this frees memory). Returns the count."""
        before = self.size()
        for address, lru in list(self._lru.items()):
            self._evict(address, lru, now)
            if not lru:
                del self._lru[address]
        return before - self.size()

    def remove_endpoint(self, address: str) -> None:
        lru = self._lru.pop(address, None)
        self._capacity.pop(address, None)
        if not lru:
            return
        roots = self._roots
        for key in lru:
            holders = roots.get(key)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del roots[key]

    def size(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def endpoint_size(self, address: str) -> int:
        lru = self._lru.get(address)
        return len(lru) if lru is not None else 0

    def set_capacity(self, address: str, blocks: int) -> None:
        if blocks <= 0:
            raise ValueError("capacity must be positive")
        if self._capacity.get(address) == blocks:
            return
        self._capacity[address] = blocks
        lru = self._lru.get(address)
        if lru is not None:
            self._evict(address, lru, None)

    def has_room(self, address: str) -> bool:
        return self.endpoint_size(address) < self.capacity(address)

    def capacity(self, address: str) -> int:
        return self._capacity.get(address, self.default_capacity)
