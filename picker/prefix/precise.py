"""What each pod's prefix cache holds, as its own KV events say: the precise view beside the approximate index.

Keys are ours, not vLLM's: block i of a token sequence is `xxh3_64(its token ids, seed=key of block i-1)`, the
first block seeded by the adapter name (an adapter's blocks differ from the base model's, as in vLLM). So vLLM's
hash seed and algorithm do not matter, and a request's keys come from its token ids alone. vLLM's own hashes are
kept only to find a block again when it is removed (engine hash -> our key).

A pick adds the request's keys to the chosen pod as speculative entries for `speculative_s` (closing the gap
between a pick and the pod's BlockStored); a stored block makes its entry real. A pod's view is trusted only while
it is `fresh`: its events arrive in order (a gap that could not be filled, or a restart of its publisher, clears
it and distrusts it for `resync_s`), and its scraped prefix-cache misses have not run ahead of its events (work the
pod did whose blocks we never heard of: lost events, or traffic on another publisher). An untrusted pod is scored
from the approximate index instead.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from xxhash import xxh3_64_intdigest

from picker.endpoints.state import Endpoint
from picker.kvevents.events import GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent


def root_key(adapter: str | None, salt: str | None = None) -> int:
    """The seed of a chain: the adapter's name (none: the base model) and the request's cache_salt (vLLM puts it
    in the first block's extra keys: blocks of another salt, or of none, are another chain)."""
    material = (adapter or "").encode("utf-8", "surrogatepass")
    if salt:
        material += b"\x00" + salt.encode("utf-8", "surrogatepass")
    return xxh3_64_intdigest(b"picker-precise:" + material)


_ITEM = array("I").itemsize  # bytes of one token id as hashed


def chain(tokens: Sequence[int], block_size: int, parent: int, blocks: int | None = None) -> list[int]:
    """The chained keys of the first `blocks` full blocks of `tokens` (all of them by default), after `parent`."""
    raw = (tokens if isinstance(tokens, array) else array("I", tokens)).tobytes()
    width = block_size * _ITEM
    count = len(raw) // width if blocks is None else min(blocks, len(raw) // width)
    out = []
    for i in range(count):
        parent = xxh3_64_intdigest(raw[i * width:(i + 1) * width], parent)
        out.append(parent)
    return out


def token_keys(tokens: Sequence[int], block_size: int, adapter: str | None = None,
               limit: int | None = None, salt: str | None = None) -> list[int]:
    """Our key of every full block of `tokens` (a partial last block is never cached by vLLM)."""
    return chain(tokens, block_size, root_key(adapter, salt), limit)


def _salt_of(event: BlockStored) -> str | None:
    """The cache_salt of a chain's first block: its extra keys beyond the adapter's name."""
    first = event.extra_keys[0] if event.extra_keys else None
    if not isinstance(first, list):
        return None
    extra = [k for k in first if isinstance(k, str) and k != event.lora_name]
    return extra[-1] if extra else None


def _opaque_extras(event: BlockStored, salt: str | None) -> list[bytes | None] | None:
    """Per block, what its extra keys carry beyond the adapter's name and the chain's salt, serialised; None when no
    block carries more. vLLM adds a media item's identifier and offset to the blocks holding its placeholder tokens
    (a hash of the item's processed content) and a digest to blocks of prompt embeddings: a request's token ids
    say neither, so such blocks, and the chain after them, must not match a prompt by its tokens alone (two images
    of one size after the same text have the same placeholder tokens)."""
    opaque: list[bytes | None] = []
    found = False
    for i, keys in enumerate(event.extra_keys):
        rest = [k for k in keys or () if k != event.lora_name and not (i == 0 and k == salt and isinstance(k, str))]
        opaque.append(repr(rest).encode() if rest else None)
        found = found or bool(rest)
    return opaque if found else None


def _opaque_chain(tokens: Sequence[int], block_size: int, parent: int, opaque: Sequence[bytes | None]) -> list[int]:
    """`chain`, with each block that carries opaque extra keys keyed on them too (so only an event can name it)."""
    out = []
    for i, extra in enumerate(opaque):
        parent = chain(tokens[i * block_size:(i + 1) * block_size], block_size, parent)[0]
        if extra is not None:
            parent = xxh3_64_intdigest(extra, parent)
        out.append(parent)
    return out


# What a block found only in an offloading tier is worth against one in device memory (1.0): the share of its
# recompute a load saves. vLLM loads an offloaded prefix into device memory before the request runs; from host
# memory that costs ~0.1 of recomputing it on an 8B model (KV bytes per token over PCIe against prefill FLOPs per
# token), from storage more. A medium not listed weighs as the least of the listed offloading tiers.
DEFAULT_MEDIUM_WEIGHTS: dict[str, float] = {GPU: 1.0, "CPU": 0.8, "STORAGE": 0.5}


def medium_weight(weights: Mapping[str, float], medium: str) -> float:
    weight = weights.get(medium)
    if weight is None:
        weight = min((w for m, w in weights.items() if m != GPU), default=0.0)
    return weight


class Match(NamedTuple):
    """The leading blocks of a prompt a pod holds."""

    device: int  # in device memory (or believed to be computing)
    offloaded: int  # after those, held only by an offloading tier
    worth: float  # device blocks + each offloaded one weighed by its fastest medium


@dataclass(slots=True)
class PodCache:
    """One pod's blocks: engine hash -> our key, and how many engine blocks of each medium hold each key.

    A block lives in device memory (GPU) and, with KV offloading, also in host memory or storage: vLLM reports
    each medium's stores and evictions apart, under the same block hash, so a block evicted from the GPU may still
    be held by a slower tier."""

    keys: dict[BlockHash, int] = field(default_factory=dict)  # while any medium holds the engine hash
    refs: dict[str, dict[BlockHash, int]] = field(default_factory=dict)  # medium -> stores not yet removed
    held: dict[int, int] = field(default_factory=dict)  # our key -> GPU engine hashes that hold it
    offloaded: dict[str, dict[int, int]] = field(default_factory=dict)  # other medium -> our key -> hashes
    block_size: int = 0
    speculative: dict[int, float] = field(default_factory=dict)  # our key -> until when it is believed
    events_at: float = -1.0  # when its last batch was applied (-1: never)
    distrust_until: float = -1.0  # after a reset we could not follow: not trusted before this
    misses_at_event: float | None = None  # its scraped prefix-cache misses (tokens) as of its last batch
    lagging: bool = False  # its scrapes show work its events never told of

    def _holders(self, medium: str) -> dict[int, int]:
        if medium == GPU:
            return self.held
        holders = self.offloaded.get(medium)
        if holders is None:
            holders = self.offloaded[medium] = {}
        return holders

    def _refs(self, medium: str) -> dict[BlockHash, int]:
        refs = self.refs.get(medium)
        if refs is None:
            refs = self.refs[medium] = {}
        return refs

    def store(self, event: BlockStored) -> None:
        """Apply a BlockStored (a parent we never heard of leaves that chain unknown: its blocks are not keyed; a
        tier's placeholder keys only blocks already known)."""
        medium = event.medium
        if event.placeholder:
            known = self.keys
            self._hold(medium, [(h, k) for h in event.block_hashes if (k := known.get(h)) is not None])
            return
        self.block_size = event.block_size
        salt = _salt_of(event) if event.parent_block_hash is None else None
        if event.parent_block_hash is None:
            parent = root_key(event.lora_name, salt)
        else:
            known_parent = self.keys.get(event.parent_block_hash)
            if known_parent is None:
                return
            parent = known_parent
        opaque = _opaque_extras(event, salt)
        keys = chain(event.token_ids, event.block_size, parent) if opaque is None else \
            _opaque_chain(event.token_ids, event.block_size, parent, opaque)
        self._hold(medium, zip(event.block_hashes, keys, strict=True))

    def _hold(self, medium: str, blocks: Iterable[tuple[BlockHash, int]]) -> None:
        refs, holders, keys, speculative = self._refs(medium), self._holders(medium), self.keys, self.speculative
        for engine_hash, key in blocks:
            count = refs.get(engine_hash, 0)
            if not count:
                keys[engine_hash] = key
                holders[key] = holders.get(key, 0) + 1
            refs[engine_hash] = count + 1  # a second physical block of the same hash: removed once per block
            if medium == GPU:
                speculative.pop(key, None)

    def remove(self, event: BlockRemoved) -> None:
        refs = self.refs.get(event.medium)
        if refs is None:
            return
        holders = self._holders(event.medium)
        for engine_hash in event.block_hashes:
            count = refs.get(engine_hash, 0)
            if count > 1:
                refs[engine_hash] = count - 1
                continue
            if refs.pop(engine_hash, None) is None:
                continue
            key = self.keys.get(engine_hash)
            if key is None:
                continue
            left = holders[key] - 1
            if left:
                holders[key] = left
            else:
                del holders[key]
            if not any(engine_hash in other for other in self.refs.values()):
                del self.keys[engine_hash]

    def medium_blocks(self) -> dict[str, int]:
        """How many of our keys each medium holds (a block in device memory and host memory counts in both)."""
        return {GPU: len(self.held), **{medium: len(holders) for medium, holders in self.offloaded.items()}}

    def clear(self) -> None:
        self.keys.clear()
        self.refs.clear()
        self.held.clear()
        self.offloaded.clear()
        self.speculative.clear()

    def matched(self, keys: Sequence[int], now: float) -> int:
        """Leading keys the pod holds in any medium."""
        match = self.match(keys, now)
        return match.device + match.offloaded

    def match(self, keys: Sequence[int], now: float, weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS) -> Match:
        """Leading keys the pod holds: first those in device memory (or believed to be computing), then, as vLLM
        loads what follows from an offloading tier, those a tier holds."""
        n = 0
        held, speculative = self.held, self.speculative
        for key in keys:
            if key not in held:
                until = speculative.get(key)
                if until is None or until < now:
                    break
            n += 1
        if not self.offloaded or n == len(keys):
            return Match(n, 0, float(n))
        tiers = [(medium_weight(weights, m), holders) for m, holders in self.offloaded.items() if holders]
        worth = float(n)
        offloaded = 0
        for i in range(n, len(keys)):
            key = keys[i]
            best = max((w for w, holders in tiers if key in holders), default=-1.0)
            if best < 0:
                break
            worth += best
            offloaded += 1
        return Match(n, offloaded, worth)


class PreciseIndex:
    """Every pod's PodCache, fed by its KV events; read by the scheduler for pods it trusts."""

    def __init__(self, *, speculative_s: float = 2.0, resync_s: float = 30.0, lag_s: float = 2.0,
                 lag_blocks: int = 2) -> None:
        self.pods: dict[str, PodCache] = {}
        self.speculative_s = speculative_s
        self.resync_s = resync_s
        self.lag_s = lag_s  # how far a pod's scrape may run ahead of its events before the view is distrusted
        self.lag_blocks = lag_blocks  # ... by how many blocks' worth of computed tokens

    def pod(self, address: str) -> PodCache:
        cache = self.pods.get(address)
        if cache is None:
            cache = self.pods[address] = PodCache()
        return cache

    def apply(self, address: str, events: Iterable[KVEvent], now: float) -> None:
        """One batch of a pod's events, in its order."""
        cache = self.pod(address)
        for event in events:
            if isinstance(event, BlockStored):
                cache.store(event)
            elif isinstance(event, BlockRemoved):
                cache.remove(event)
            elif isinstance(event, AllBlocksCleared):
                cache.clear()
        cache.events_at = now
        cache.lagging = False

    def observe_scrape(self, address: str, misses: float, scraped_at: float) -> None:
        """The pod's scraped prefix-cache misses (tokens it computed, `queries - hits`). A scrape soon after a
        batch accounts for that batch's work; a later one that shows `lag_blocks` blocks more than that is work
        whose events never came: the view is distrusted until events flow again."""
        cache = self.pods.get(address)
        if cache is None or cache.events_at < 0:
            return
        if cache.misses_at_event is None or scraped_at - cache.events_at <= self.lag_s:
            cache.misses_at_event = misses
            cache.lagging = False
        else:
            cache.lagging = misses - cache.misses_at_event >= self.lag_blocks * max(1, cache.block_size)

    def reset(self, address: str, now: float) -> None:
        """The pod's stream broke in a way we could not follow (an unfilled gap, a restarted publisher): what we
        hold may be wrong, so forget it and distrust the pod until its events have rebuilt a view."""
        cache = self.pod(address)
        cache.clear()
        cache.distrust_until = now + self.resync_s

    def forget(self, address: str) -> None:
        self.pods.pop(address, None)

    def fresh(self, address: str, now: float) -> bool:
        """Whether the pod's view may be used: its events have come, no reset is being waited out, and its
        scrapes show no work its events did not tell of."""
        cache = self.pods.get(address)
        return cache is not None and cache.events_at >= 0 and now >= cache.distrust_until and not cache.lagging

    def picked(self, address: str, keys: Sequence[int], now: float) -> None:
        """The request with these keys went to the pod: believe its blocks are there until they are stored."""
        cache = self.pod(address)
        until = now + self.speculative_s
        speculative = cache.speculative
        for key in keys:
            if key not in cache.held:
                speculative[key] = until
        if len(speculative) > 4 * (len(keys) + 1024):  # drop what has expired, now and then
            for key in [k for k, t in speculative.items() if t < now]:
                del speculative[key]


PrefixMode = Literal["approximate", "precise", "auto"]
MAX_PRECISE_BLOCKS = 1024  # blocks of a prompt looked up (64k tokens at vLLM's GPU block size of 64)


class PrecisePrefix:
    """The scheduler's precise source: for the pods it vouches for, how many of the prompt's tokens each one's
    cache holds. `auto`: the pods whose view is fresh (the rest keep the approximate index's match); `precise`:
    every pod (one whose events never came holds nothing)."""

    def __init__(self, index: PreciseIndex, mode: PrefixMode = "auto") -> None:
        self.index = index
        self.mode = mode

    def matches(self, tokens: Sequence[int], model: str, endpoints: Sequence[Endpoint], now: float,
                salt: str | None = None, weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS,
                ) -> tuple[list[int], dict[str, int], dict[str, int] | None]:
        """The prompt's block keys, {address: tokens held} of the pods vouched for (nothing: no keys), a token held
        only by an offloading tier counting as its medium's weight of one, and {address: such tokens} of the pods
        holding any (None: none does)."""
        pods = self.index.pods
        if self.mode == "auto":
            vouched = [e for e in endpoints if self.index.fresh(e.address, now)]
        else:
            vouched = list(endpoints)
        block_size = next((c.block_size for e in vouched if (c := pods.get(e.address)) is not None and c.block_size),
                          0) or next((e.metrics.block_size for e in vouched if e.metrics.block_size), 0)
        if not vouched or not block_size:
            return [], {}, None
        first = vouched[0].metrics
        adapter = None if not first.models or model in first.models else model  # not a base model: an adapter
        keys = token_keys(tokens, block_size, adapter, limit=MAX_PRECISE_BLOCKS, salt=salt)
        held = {}
        offloaded: dict[str, int] | None = None
        for e in vouched:
            cache = pods.get(e.address)
            if cache is None:
                held[e.address] = 0
                continue
            _, tier_blocks, worth = cache.match(keys, now, weights)
            held[e.address] = round(worth * block_size)
            if tier_blocks:
                if offloaded is None:
                    offloaded = {}
                offloaded[e.address] = tier_blocks * block_size
        return keys, held, offloaded

    def picked(self, keys: Sequence[int], address: str, now: float) -> None:
        self.index.picked(address, keys, now)
