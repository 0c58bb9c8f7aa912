"""Block-level KV cache with vLLM V1 prefix-caching semantics.

What is modelled, because routing quality depends on it:
- `num_blocks` blocks of `block_size` tokens; block 0 is the reserved null block (as in vLLM), so usage is
  `1 - free / (num_blocks - 1)`.
- Only full blocks are cached, keyed by a chained hash `H(parent, tokens, extra_keys)`; several physical blocks may
  carry the same hash (two requests computing the same block concurrently), lookups use the first.
- Reference counts: a block in use by a request is never evicted.
- Free-block queue: cached blocks whose ref count drops to 0 go to the tail (a request's blocks in *reverse* order,
  so its tail blocks are evicted first); blocks without a hash go to the head (reused first); allocation pops from
  the head and evicts the block's cached hash if it has one (emitting BlockRemoved); a prefix-cache hit on a free
  block takes it out of the queue. (Checked against vLLM 0.32's v1/core/block_pool.py and a real CPU server:
  bench/validate_sim.py.)
- KV offloading to host memory (vLLM's OffloadingConnector with a CPU tier, `host_blocks` > 0): each prompt block
  is copied to the tier when computed (write-through, as the connector stores a request's new blocks after its
  step); the tier is an LRU of `host_blocks` hashes, so a block the device evicted may still be loaded from it.
  Events as the connector sends them by default (no `self_describing_kv_events`): a BlockStored naming the hashes
  only, medium CPU, and a BlockRemoved of medium CPU when the tier evicts.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from picker.kvevents.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

HOST_MEDIUM = "CPU"  # vLLM's name for the host-memory tier in KV events
NONE_HASH = xxhash.xxh3_64_intdigest(b"vllm-none-hash")


def hash_block(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """Chained block hash: xxh3_64 over (parent hash, extra keys, token ids)."""
    data = parent.to_bytes(8, "little") + len(extra).to_bytes(4, "little") + extra + array("I", tokens).tobytes()
    return xxhash.xxh3_64_intdigest(data)


def extra_keys_for(block_index: int, lora_name: str | None, cache_salt: str | None) -> list[str] | None:
    """Per-block extra keys as vLLM reports them: the LoRA name on every block, the cache salt on block 0."""
    keys: list[str] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return keys or None


def _extra_bytes(keys: list[str] | None) -> bytes:
    """Length-prefixed extra keys. "surrogatepass": any str hashes (valid text gives the same bytes as plain
    UTF-8), so a lone surrogate in a cache_salt cannot raise inside an engine step (it used to kill the
    engine loop)."""
    extra = "\x00".join(keys).encode("utf-8", "surrogatepass") if keys else b""
    return len(extra).to_bytes(4, "little") + extra


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> None:
    """Append to `hashes` the hashes of the full blocks of `token_ids` not hashed yet (in place: cheap per step).

    Same bytes as `hash_block`, but the token ids are packed once per call (this is the simulator's hot path).
    """
    start = len(hashes)
    end = len(token_ids) // block_size
    if end <= start:
        return
    parent = hashes[-1] if hashes else NONE_HASH
    raw = array("I", token_ids[start * block_size : end * block_size]).tobytes()
    width = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    tail = _extra_bytes(extra_keys_for(1, lora_name, cache_salt))
    for i in range(start, end):
        extra = tail if i else _extra_bytes(extra_keys_for(0, lora_name, cache_salt))
        off = (i - start) * width
        parent = digest(parent.to_bytes(8, "little") + extra + raw[off : off + width])
        hashes.append(parent)


def block_hashes(
    token_ids: Sequence[int], block_size: int, lora_name: str | None = None, cache_salt: str | None = None
) -> list[int]:
    """Hashes of all full blocks of `token_ids`."""
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size, lora_name, cache_salt)
    return hashes


class KVCache:
    """Physical blocks, reference counts, the prefix-cache map and the free-block queue."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, dict[int, None]] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.events: list[KVEvent] = []
        self.record_events = False
        self.host_blocks = host_blocks
        self.host: OrderedDict[int, None] = OrderedDict()  # hashes in host memory, least recently used first

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated (free, possibly holding an evictable cached prefix)."""
        return len(self.free_queue)

    def usage(self) -> float:
        """vllm:kv_cache_usage_perc."""
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def num_cached_blocks(self) -> int:
        """Distinct hashes currently in the prefix cache."""
        return len(self.cached)

    def has_room(self) -> bool:
        """Some free block holds no cached prefix: the next allocation evicts nothing. Such blocks are always at
        the head of the free queue (never used, or put back there by `free`), where allocation takes from."""
        queue = self.free_queue
        return bool(queue) and self.block_hash[next(iter(queue))] is None

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (at most `max_blocks`), without touching them."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        cached = self.cached
        for h in hashes[:max_blocks]:
            blocks = cached.get(h)
            if not blocks:
                break
            found.append(next(iter(blocks)))
        return found

    def lookup_host(self, hashes: Sequence[int], start: int, max_blocks: int) -> int:
        """How many of `hashes[start:max_blocks]`, in a row, host memory holds (marked recently used)."""
        host = self.host
        n = 0
        for h in hashes[start:max_blocks]:
            if h not in host:
                break
            host.move_to_end(h)
            n += 1
        return n

    def offload(self, hashes: Sequence[int]) -> None:
        """Copy these computed blocks to host memory (those already there just become recently used)."""
        if not self.host_blocks:
            return
        host = self.host
        new: list[int] = []
        for h in hashes:
            if h in host:
                host.move_to_end(h)
                continue
            host[h] = None
            new.append(h)
        evicted: list[int] = []
        while len(host) > self.host_blocks:
            evicted.append(host.popitem(last=False)[0])
        if self.record_events:  # a block both copied and evicted within this call is never announced
            kept: list[BlockHash] = [h for h in new if h in host]
            if kept:
                self.events.append(BlockStored(kept, None, [], 0, None, None, [None] * len(kept), HOST_MEDIUM))
            fresh = set(new)
            removed: list[BlockHash] = [h for h in evicted if h not in fresh]
            if removed:
                self.events.append(BlockRemoved(removed, HOST_MEDIUM))

    # --- allocation ----------------------------------------------------------------------------------------
    def can_allocate(self, num_new: int, hit_blocks: Sequence[int] = ()) -> bool:
        """Whether `num_new` fresh blocks plus touching `hit_blocks` fits in the free queue."""
        evictable_hits = sum(1 for b in hit_blocks if self.ref_cnt[b] == 0)
        return num_new + evictable_hits <= len(self.free_queue)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on prefix-cache hits; free ones leave the free queue."""
        ref = self.ref_cnt
        for b in blocks:
            if ref[b] == 0:
                del self.free_queue[b]
            ref[b] += 1

    def allocate(self, num_new: int) -> list[int]:
        """Pop `num_new` blocks from the head of the free queue, evicting their cached hashes."""
        out: list[int] = []
        queue = self.free_queue
        for _ in range(num_new):
            b, _unused = queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self._evict(b, h)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def _evict(self, block: int, h: int) -> None:
        self.block_hash[block] = None
        blocks = self.cached.get(h)
        if blocks is not None:
            blocks.pop(block, None)
            if not blocks:
                del self.cached[h]
        if self.record_events:
            self.events.append(BlockRemoved([h]))

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block of a request (visited last block first, as vLLM frees them).

        Cached blocks reaching 0 join the tail of the free queue (LRU eviction); blocks without a hash (partial
        blocks) go to the *front*, to be reused first, as vLLM 0.32's BlockPool.free_blocks does.
        """
        ref = self.ref_cnt
        queue = self.free_queue
        block_hash = self.block_hash
        uncached: list[int] = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if block_hash[b] is None:
                    uncached.append(b)
                else:
                    queue[b] = None
        for b in reversed(uncached):
            queue[b] = None
            queue.move_to_end(b, last=False)

    # --- caching -------------------------------------------------------------------------------------------
    def cache_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: Sequence[int],
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> None:
        """Register blocks[start:end] (now full and computed) in the prefix cache; one BlockStored per call."""
        if not self.enable_prefix_caching or end <= start:
            return
        stored: list[int] = []
        for i in range(start, end):
            b = blocks[i]
            if self.block_hash[b] is not None:
                continue
            h = hashes[i]
            self.block_hash[b] = h
            entry = self.cached.get(h)
            if entry is None:
                self.cached[h] = {b: None}
            else:
                entry[b] = None
            stored.append(i)
        if self.record_events and stored:
            first, last = stored[0], stored[-1] + 1
            bs = self.block_size
            self.events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in range(first, last)],
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=list(token_ids[first * bs : last * bs]),
                    block_size=bs,
                    lora_id=lora_id,
                    lora_name=lora_name,
                    extra_keys=[extra_keys_for(i, lora_name, cache_salt) for i in range(first, last)],
                )
            )

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's /reset_prefix_cache, here with its `reset_connector`: host memory too,
        as the picker forgets every medium on AllBlocksCleared); refused while blocks are in use."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.host.clear()
        self.block_hash = [None] * self.num_blocks
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def wipe(self) -> None:
        """A restart's empty cache: every cached hash forgotten, also of blocks in use (they free uncached)."""
        self.cached.clear()
        self.host.clear()
        self.block_hash = [None] * self.num_blocks
        if self.record_events:
            self.events.append(AllBlocksCleared())

    def drain_events(self) -> list[KVEvent]:
        """Events since the last call."""
        events, self.events = self.events, []
        return events
