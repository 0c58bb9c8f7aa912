"""The benchmarks' baseline policies as scorers: round-robin, rendezvous hashing of the prompt's start, a
consistent-hash ring, the ring with bounded loads, and the text tree of SGLang's router (its `cache_aware` policy,
which vllm-router shares), so the simulator can set the peer routers' policy beside the picker.

Each scores the candidates in [0, 1] so that the max-score picker takes the baseline's choice first and its next
ones as Envoy's fallbacks: round-robin and the rings by place in their order (first 1, then evenly towards 0),
rendezvous hashing by each pod's hash of the prompt. The strategy table (`STRATEGY_CONFIGS` in
`picker.scheduling.config`) runs each as an ordinary one-profile scheduling config, as it runs the cache-blind
least-load and the ratio-only prefix baselines, which need no plugin of their own; none reads a model server's
metrics.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import xxhash
from pydantic import Field

from picker.core.requests import InferenceRequest
from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.prefix.hashing import prefix_keys
from picker.prefix.memory import InMemoryPrefixIndex
from picker.scheduling.context import SchedulingContext, effective_model
from picker.scheduling.plugins import NoParams, Plugin, PluginFactory, default_of, no_params, with_params


def _by_rank(candidates: Sequence[Endpoint], ranking: Sequence[Endpoint]) -> list[float]:
    """Scores in [0, 1] that order `candidates` as `ranking` does: the first 1.0, the last 1/n."""
    n = len(ranking)
    place = {id(e): i for i, e in enumerate(ranking)}
    return [1.0 - place[id(e)] / n for e in candidates]


class RoundRobinScorer(Plugin):
    """Each pick moves the start of the rotation on by one (Envoy's default policy)."""

    type_name = "round-robin-scorer"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._next = 0

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        n = len(candidates)
        start = self._next % n
        return [1.0 - ((i - start) % n) / n for i in range(n)]

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        self._next += 1


def _prefix_key(request: InferenceRequest, prefix_chars: int) -> bytes:
    """What the hash baselines hash: the model and the prompt's first `prefix_chars` characters."""
    return f"{effective_model(request)}\0{request.prompt_text[:prefix_chars]}".encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=4096)
def _address_seed(address: str) -> int:
    """A stable 64-bit seed per endpoint address (rendezvous hashing's per-node salt), hashed once per pod."""
    return xxhash.xxh64_intdigest(address.encode())


_HASH_SPAN = float(2**64)


class PrefixHashScorer(Plugin):
    """Rendezvous hash of the prompt's first `prefix_chars` characters: no index, no load.

    The trivial cache-aware baseline: identical prefixes always land on the same pod (while the pod set is
    unchanged; a pod leaving moves only its own share), so a router that looks at load must beat this."""

    type_name = "prefix-hash-scorer"

    def __init__(self, name: str | None = None, *, prefix_chars: int = 1000) -> None:
        super().__init__(name)
        if prefix_chars <= 0:
            raise ValueError("prefixChars must be positive")
        self.prefix_chars = prefix_chars

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        key = _prefix_key(ctx.request, self.prefix_chars)
        return [xxhash.xxh64_intdigest(key, seed=_address_seed(e.address)) / _HASH_SPAN for e in candidates]


class HashRingScorer(Plugin):
    """Consistent hashing on a ring with `virtual_nodes` points per pod: the simple router a user tries first.

    The prompt's first `prefix_chars` characters pick a point on the ring; the first pod clockwise serves it, the
    next distinct pods are the fallbacks. Many virtual nodes per pod keep the pods' shares of the key space within
    a few percent of each other, which a plain hash-mod or a few points per pod do not."""

    type_name = "hash-ring-scorer"

    def __init__(self, name: str | None = None, *, prefix_chars: int = 1000, virtual_nodes: int = 200) -> None:
        super().__init__(name)
        if prefix_chars <= 0 or virtual_nodes <= 0:
            raise ValueError("prefixChars and virtualNodes must be positive")
        self.prefix_chars = prefix_chars
        self.virtual_nodes = virtual_nodes
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, endpoints: Sequence[Endpoint]) -> tuple[list[int], list[str]]:
        """The ring's sorted points and their pods, rebuilt only when the pod set changes."""
        addresses = tuple(sorted(e.address for e in endpoints))
        if addresses != self._ring_for:
            points = sorted((xxhash.xxh64_intdigest(f"{a}#{v}".encode()), a)
                            for a in addresses for v in range(self.virtual_nodes))
            self._points = [p for p, _ in points]
            self._owners = [a for _, a in points]
            self._ring_for = addresses
        return self._points, self._owners

    def ring_order(self, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """Every pod once, in the order met walking clockwise from the prompt's point on the ring."""
        points, owners = self._ring(endpoints)
        by_address = {e.address: e for e in endpoints}
        start = bisect.bisect_left(points, xxhash.xxh64_intdigest(_prefix_key(request, self.prefix_chars)))
        order: list[Endpoint] = []
        seen: set[str] = set()
        n = len(points)
        for i in range(n):
            owner = owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                order.append(by_address[owner])
                if len(order) == len(by_address):
                    break
        return order

    def choose(self, order: list[Endpoint]) -> list[Endpoint]:
        """The ranking from the ring order (the plain ring keeps it as it is)."""
        return order

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        return _by_rank(candidates, self.choose(self.ring_order(ctx.request, candidates)))


class BoundedLoadScorer(HashRingScorer):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam; KubeAI's prefix-hash balancing).

    A key goes to the first pod clockwise whose in-flight requests, this one included, stay within
    `ceil(load_factor x (all in-flight + 1) / pods)`; a full pod passes the key to the next. Hot keys overflow to
    the next pods on the ring, always the same ones, so their prefixes get a small stable set of holders. The load
    is the router's own in-flight count: no metrics."""

    type_name = "bounded-load-scorer"

    def __init__(self, name: str | None = None, *, prefix_chars: int = 1000, virtual_nodes: int = 200,
                 load_factor: float = 1.25) -> None:
        super().__init__(name, prefix_chars=prefix_chars, virtual_nodes=virtual_nodes)
        if load_factor < 1.0:
            raise ValueError("loadFactor must be at least 1")
        self.load_factor = load_factor

    def choose(self, order: list[Endpoint]) -> list[Endpoint]:
        capacity = math.ceil(self.load_factor * (sum(e.in_flight for e in order) + 1) / len(order))
        for i, e in enumerate(order):
            if e.in_flight + 1 <= capacity:
                return [e, *order[:i], *order[i + 1:]]
        return order


# SGLang router's budget for each pod's text tree (--max-tree-size), in characters.
TEXT_TREE_CHARS = 64 * 1024 * 1024


class TextTreeScorer(Plugin):
    """SGLang router's `cache_aware` policy: a tree of the text the router has sent each pod, and its own in-flight
    counts; no metrics.

    While the in-flight counts are in balance, a request goes to the pod whose sent text shares the longest prefix
    with the prompt when that prefix is over `cache_threshold` of it, else to the pod that has been sent the least
    distinct text (a new pod takes every new prefix). Out of balance (the busiest pod more than
    `balance_abs_threshold` requests and `balance_rel_threshold` times over the idlest), the idlest takes it.
    Where several pods hold the longest match, the one with the fewest in flight takes it (the router takes the
    first its tree lists: ours is the kinder reading). Defaults are the router's. The tree is our prefix index in
    `block_chars` blocks (the router's is per character), each pod's trimmed least recently sent first past the
    router's budget, with no expiry; a pod's tree size is its count of blocks."""

    type_name = "text-tree-scorer"

    def __init__(self, name: str | None = None, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, block_chars: int = 64) -> None:
        super().__init__(name)
        if not 0 <= cache_threshold <= 1 or balance_abs_threshold < 0 or balance_rel_threshold < 1 or block_chars <= 0:
            raise ValueError("cacheThreshold must be in [0, 1], balanceAbsThreshold >= 0, balanceRelThreshold >= 1 "
                             "and blockChars > 0")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_chars = block_chars
        self._tree = InMemoryPrefixIndex(TEXT_TREE_CHARS // block_chars, ttl=None)

    def choose(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> Endpoint:
        loads = [e.in_flight for e in candidates]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.balance_abs_threshold and busiest > idlest * self.balance_rel_threshold:
            return candidates[loads.index(idlest)]
        text = ctx.request.prompt_text
        keys = self._keys(ctx.request)
        if ctx.state is None:
            ctx.state = {}
        ctx.state[self.name] = keys
        matched = self._tree.match(keys, {e.address for e in candidates}, ctx.now)
        longest = max(matched.values(), default=0)
        if text and min(longest * self.block_chars, len(text)) / len(text) > self.cache_threshold:
            return min((e for e in candidates if matched.get(e.address) == longest), key=lambda e: e.in_flight)
        return min(candidates, key=lambda e: self._tree.endpoint_size(e.address))

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        """The router's choice first; the others (Envoy's fallbacks) by their in-flight counts."""
        chosen = self.choose(ctx, candidates)
        rest = sorted((e for e in candidates if e is not chosen), key=lambda e: e.in_flight)
        return _by_rank(candidates, [chosen, *rest])

    def _keys(self, request: InferenceRequest) -> list[int]:
        """The whole prompt's chained block keys (the router inserts and matches all of it)."""
        return prefix_keys(request.prompt_text, _address_seed(effective_model(request)), self.block_chars,
                           len(request.prompt_text) // self.block_chars + 1)

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        """The prompt joins the tree of the pod it went to (as the router inserts it at every pick)."""
        kept = ctx.state.get(self.name) if ctx.state else None
        keys = cast(list[int], kept) if kept is not None else self._keys(ctx.request)  # None: sent by balance
        self._tree.record(keys, endpoint.address, now)


class PrefixHashParams(Section):
    prefix_chars: int = Field(default_of(PrefixHashScorer, "prefix_chars"), gt=0)


class HashRingParams(Section):
    prefix_chars: int = Field(default_of(HashRingScorer, "prefix_chars"), gt=0)
    virtual_nodes: int = Field(default_of(HashRingScorer, "virtual_nodes"), gt=0)


class BoundedLoadParams(HashRingParams):
    load_factor: float = Field(default_of(BoundedLoadScorer, "load_factor"), ge=1)


class TextTreeParams(Section):
    cache_threshold: float = Field(default_of(TextTreeScorer, "cache_threshold"), ge=0, le=1)
    balance_abs_threshold: int = Field(default_of(TextTreeScorer, "balance_abs_threshold"), ge=0)
    balance_rel_threshold: float = Field(default_of(TextTreeScorer, "balance_rel_threshold"), ge=1)
    block_chars: int = Field(default_of(TextTreeScorer, "block_chars"), gt=0)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(RoundRobinScorer.type_name, NoParams, no_params(RoundRobinScorer)),
    PluginFactory(PrefixHashScorer.type_name, PrefixHashParams, with_params(PrefixHashScorer)),
    PluginFactory(HashRingScorer.type_name, HashRingParams, with_params(HashRingScorer)),
    PluginFactory(BoundedLoadScorer.type_name, BoundedLoadParams, with_params(BoundedLoadScorer)),
    PluginFactory(TextTreeScorer.type_name, TextTreeParams, with_params(TextTreeScorer)),
)
