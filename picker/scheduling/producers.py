"""Prefix sources: what a request's cycle state learns of the pods' caches before any filter or scorer reads it.

Each producer is a plugin of the plugin table (`approx-prefix-cache-producer`, `precise-prefix-cache-producer`)
that writes typed fields of the `SchedulingContext` (the block width, the prompt's keys, how many blocks each pod
holds) and learns from the pick; the scheduler runs them in the table's order and knows none of them. The
approximate index comes first (every pod gets a match from our own picks); the precise view then overwrites the
match of the pods whose KV events it trusts. Both are implied: built without being listed whenever their inputs
exist (an index; a KV-event subscription). The prompt's token ids, which the precise view reads, are not a
producer: tokenizing may await a pod's /tokenize, and producers run inside the synchronous scheduler, so the
director tokenizes before it schedules (`picker.prefix.tokens.PromptTokenizer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from pydantic import Field, field_validator

from picker.core.replicas import ReplicaView
from picker.core.requests import InferenceRequest
from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.prefix.chars_per_token import CharsPerToken
from picker.prefix.hashing import PrefixHasher, prefix_keys
from picker.prefix.index import PrefixIndex
from picker.prefix.precise import DEFAULT_MEDIUM_WEIGHTS, PrecisePrefix
from picker.scheduling.context import SchedulingContext, effective_model
from picker.scheduling.memory import PodMemory
from picker.scheduling.plugins import NoParams, PeerPick, Plugin, PluginDeps, PluginFactory, default_of


@runtime_checkable
class PrefixProducer(Protocol):
    """Fills a request's prefix state before scoring and learns where it went."""

    name: str
    type_name: str

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        """Write what this source knows of the request's prefix on `endpoints` into `ctx` (a prompt is there)."""
        ...

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        """The request went to `endpoint`."""
        ...

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """Another replica sharing the prefix index routed a request (its keys are in the index already)."""
        ...

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        """The pod left the pool, or its cache is presumed lost."""
        ...

    def learned_chars_per_token(self) -> float | None:
        """Characters per token of the traffic, when this source learns it (None: it does not)."""
        ...


HOME_BLOCKS = 4  # a prompt's opening, in index blocks: what names "the same prefix" once no pod holds any of it
HOMES = 50_000  # openings whose last pod is remembered (least recently sent forgotten first)
SIZING_INTERVAL = 1.0  # seconds between two sizings of every pod's share of the index


class ApproximatePrefix(Plugin):
    """The prompt's chained character-block keys matched in the prefix index (which pods probably hold how much
    of it, learned from our own picks), and each pod's share of the index sized from its cache at the traffic's
    learned characters per token.

    Also the prompt's home: the pod its first HOME_BLOCKS blocks last went to. The index forgets a prefix when the
    pod's cache must have evicted it; sent anywhere when it comes back, it would add to another pod's working set
    and evict a prefix there, which comes back cold in turn (a real run under cache pressure moved 14-17 of 24
    prefixes a run this way and lost to a hash ring, which always sends a prefix home). Kept from every replica's
    picks (the shared index's stream carries the others'), so a prefix goes home whichever replica sent it there,
    and a replica that starts learns the homes of the stream it replays.

    Every pod's share is sized from its scraped cache before a prompt is matched (again each second, and whenever
    the learned characters per token move), not only when a pick goes to it (as it also is): a replica that has
    just replayed the shared stream would otherwise match each pod's first pick on an unbounded share, holding
    prefixes the pod has long evicted."""

    type_name = "approx-prefix-cache-producer"

    def __init__(self, index: PrefixIndex, hasher: PrefixHasher, name: str | None = None,
                 replicas: ReplicaView | None = None) -> None:
        super().__init__(name)
        self.index = index
        self.hasher = hasher
        self._homes: PodMemory[int] = PodMemory(HOMES)
        # what the traffic's prompts really are in tokens: sizes each pod's share of the index from its cache
        self.chars_per_token = CharsPerToken(hasher.chars_per_token, replicas=replicas)
        self._next_sweep = -float("inf")
        self._next_sizing = -float("inf")
        self._sized_at = self.chars_per_token.value  # characters per token the pods were last sized at

    def keys(self, request: InferenceRequest, block_chars: int) -> list[int]:
        seed = self.hasher.key.seed(effective_model(request), None, request.cache_salt)
        return prefix_keys(request.prompt_text, seed, block_chars, self.hasher.max_blocks)

    def block_chars(self, endpoints: Sequence[Endpoint]) -> int:
        """Block width from the first pod that reports its cache block size (pods of a pool share it)."""
        for endpoint in endpoints:
            size = endpoint.metrics.block_size
            if size:
                return self.hasher.block_chars(size)
        return self.hasher.block_chars(None)

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        ctx.block_chars = self.block_chars(endpoints)
        if now >= self._next_sizing or self.chars_per_token.value != self._sized_at:
            self._size_pods(endpoints, ctx.block_chars, now)
        ctx.keys = keys = self.keys(ctx.request, ctx.block_chars)
        ctx.matches = self.index.match(keys, None, now)
        if len(keys) >= HOME_BLOCKS:
            ctx.home = self._homes.get(keys[HOME_BLOCKS - 1])

    def _size_pods(self, endpoints: Sequence[Endpoint], block_chars: int, now: float) -> None:
        """Each pod's share of the index from its cache (pods whose cache is not reported yet keep the default), at
        the characters per token learned (or, by a replica that has just started, the other replicas')."""
        self._next_sizing = now + SIZING_INTERVAL
        self.chars_per_token.follow_peers()
        self._sized_at = self.chars_per_token.value
        for endpoint in endpoints:
            self._size(endpoint, block_chars)

    def _size(self, endpoint: Endpoint, block_chars: int) -> None:
        capacity = self._capacity_blocks(endpoint, block_chars)
        if capacity:
            self.index.set_capacity(endpoint.address, capacity)

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        if not ctx.keys:
            return
        request = ctx.request
        self.chars_per_token.picked(endpoint, len(request.prompt_text))
        self._size(endpoint, ctx.block_chars)  # pods another model's requests size less often than each second
        self.index.record(ctx.keys, endpoint.address, now, prompt_chars=len(request.prompt_text),
                          session_id=ctx.session)
        if len(ctx.keys) >= HOME_BLOCKS:
            self._homes.remember(ctx.keys[HOME_BLOCKS - 1], endpoint.address)
        if now >= self._next_sweep:
            self._sweep(now)

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        keys = pick.keys
        if len(keys) >= HOME_BLOCKS:
            self._homes.remember(keys[HOME_BLOCKS - 1], pick.address)
        self.chars_per_token.peer_picked(pick.address, pick.prompt_chars)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self.index.remove_endpoint(endpoint.address)
        self.chars_per_token.forget(endpoint.address)
        self._homes.forget_pod(endpoint.address)

    def learned_chars_per_token(self) -> float | None:
        return self.chars_per_token.value

    def _sweep(self, now: float) -> None:
        """Free expired entries now and then (matches already ignore them) for backends that can sweep."""
        ttl = self.index.ttl
        if not ttl:
            self._next_sweep = float("inf")
            return
        self.index.expire(now)
        self._next_sweep = now + ttl / 4

    def _capacity_blocks(self, endpoint: Endpoint, block_chars: int) -> int | None:
        """The pod's KV cache in our blocks: num_gpu_blocks x block_size tokens, re-cut into `block_chars` at the
        traffic's learned characters per token."""
        m = endpoint.metrics
        if not m.num_gpu_blocks:
            return None
        if not m.block_size:
            return m.num_gpu_blocks
        return max(1, int(m.num_gpu_blocks * m.block_size * self.chars_per_token.value) // block_chars)


class PreciseOverlay(Plugin):
    """The pods' KV events (the precise view): for each pod it vouches for, what its cache really holds of the
    prompt's tokens replaces the approximate match, in the approximate index's blocks (tokens x chars per token /
    block width) so every scorer reads it the same way. Needs the prompt's token ids (tokenized before)."""

    type_name = "precise-prefix-cache-producer"

    def __init__(self, precise: PrecisePrefix, hasher: PrefixHasher, name: str | None = None,
                 medium_weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS) -> None:
        super().__init__(name)
        self.precise = precise
        self.hasher = hasher
        self.medium_weights = medium_weights  # what a block held only by an offloading tier counts for

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        tokens = ctx.request.token_ids
        if not tokens:
            return
        keys, held, offloaded = self.precise.matches(tokens, ctx.model, endpoints, now, ctx.request.cache_salt,
                                                     self.medium_weights)
        if not keys:
            return
        ctx.precise_keys = keys
        ctx.precise_pods = frozenset(held)
        ctx.precise_offloaded = offloaded
        chars_per_token, width, most = self.hasher.chars_per_token, ctx.block_chars, len(ctx.keys)
        matches = ctx.matches
        for address, n in held.items():
            blocks = min(most, n * chars_per_token // width)
            if blocks:
                matches[address] = blocks
            else:
                matches.pop(address, None)

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        if ctx.precise_keys:
            self.precise.picked(ctx.precise_keys, endpoint.address, now)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        return None  # the view follows the pod's own events (AllBlocksCleared), not the pool

    def learned_chars_per_token(self) -> float | None:
        return None


def _approximate(name: str, params: NoParams, deps: PluginDeps) -> Plugin:
    if deps.prefix_index is None or deps.hasher is None:
        raise ValueError("the approximate prefix index needs an index to read (a strategy without one cannot run it)")
    return ApproximatePrefix(deps.prefix_index, deps.hasher, name, replicas=deps.replicas)


class PreciseParams(Section):
    # medium (vLLM's name: GPU, CPU, STORAGE) -> what a block held only there is worth against device memory
    medium_weights: dict[str, float] = Field(default_of(PreciseOverlay, "medium_weights"))

    @field_validator("medium_weights")
    @classmethod
    def _weights(cls, weights: dict[str, float]) -> dict[str, float]:
        named = {medium.strip().upper(): weight for medium, weight in weights.items()}
        bad = [m for m, w in named.items() if not m or not 0 <= w <= 1]
        if bad:
            raise ValueError(f"each medium is a name with a weight in [0, 1] (not {', '.join(bad) or 'empty'})")
        return {**DEFAULT_MEDIUM_WEIGHTS, **named}


def _precise(name: str, params: PreciseParams, deps: PluginDeps) -> Plugin:
    if deps.precise is None or deps.hasher is None:
        raise ValueError("the precise view needs the pods' KV events: set kvEventsEndpoint or kvEventsPort "
                         "(--kv-events-endpoint / --kv-events-port), prefixMode not approximate")
    return PreciseOverlay(deps.precise, deps.hasher, name, MappingProxyType(params.medium_weights))


# In the order the scheduler runs them: the approximate match first, the precise view over it.
FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(ApproximatePrefix.type_name, NoParams, _approximate, implied=lambda d: d.prefix_index is not None),
    PluginFactory(PreciseOverlay.type_name, PreciseParams, _precise, implied=lambda d: d.precise is not None),
)
