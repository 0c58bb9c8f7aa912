"""Baseline strategies for the benchmark: same Scheduler interface, deliberately simple policies. Each is built
by its line in the strategy table (`picker.scheduling.config.STRATEGY_FACTORIES`)."""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections.abc import Sequence

import xxhash

from picker.core.requests import InferenceRequest, RequestError
from picker.endpoints.state import Endpoint
from picker.prefix.hashing import PrefixHasher
from picker.prefix.index import PrefixIndex
from picker.scheduling.context import SchedulingContext
from picker.scheduling.picker import MaxScorePicker
from picker.scheduling.profiles import Profile, WeightedScorer
from picker.scheduling.scheduler import PrefixAwareScheduler
from picker.scheduling.scorers import KVCacheUtilizationScorer, PrefixCacheScorer, QueueScorer
from picker.scheduling.types import SchedulingResult


class _Stateless:
    """What a baseline without a prefix index does for the hooks it does not use."""

    @property
    def index(self) -> PrefixIndex | None:
        return None

    @property
    def learned_chars_per_token(self) -> float | None:
        return None

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        return None

    def on_peer_picked(self, address: str, prompt_chars: int, session_id: str, now: float) -> None:
        return None

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        return None


class RoundRobinScheduler(_Stateless):
    """Each pick advances the start of the rotation (Envoy's default policy)."""

    def __init__(self, max_endpoints: int = 3) -> None:
        self.max_endpoints = max_endpoints
        self._next = 0

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult:
        n = len(endpoints)
        if not n:
            raise RequestError(503, "no_endpoints", "no candidate endpoints")
        start = self._next % n
        ranked = [endpoints[(start + i) % n] for i in range(min(self.max_endpoints, n))]
        return SchedulingResult(ranked=ranked, profile="round-robin", context=SchedulingContext.of(request, now))

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        self._next += 1


class RandomScheduler(_Stateless):
    """Uniformly random endpoint."""

    def __init__(self, rng: random.Random | None = None, max_endpoints: int = 3) -> None:
        self.rng = rng if rng is not None else random.Random()
        self.max_endpoints = max_endpoints

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult:
        if not endpoints:
            raise RequestError(503, "no_endpoints", "no candidate endpoints")
        ranked = self.rng.sample(list(endpoints), min(self.max_endpoints, len(endpoints)))
        return SchedulingResult(ranked=ranked, profile="random", context=SchedulingContext.of(request, now))


class PrefixHashScheduler(_Stateless):
    """Rendezvous hash of the prompt's first `prefix_chars` characters: no index, no metrics, no load.

    The trivial cache-aware baseline: identical prefixes always land on the same pod (while the pod set is
    unchanged; a pod leaving moves only its own share), so a router that looks at load must beat this."""

    def __init__(self, prefix_chars: int = 1000, max_endpoints: int = 3) -> None:
        if prefix_chars <= 0:
            raise ValueError("prefix_chars must be positive")
        self.prefix_chars = prefix_chars
        self.max_endpoints = max_endpoints

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult:
        if not endpoints:
            raise RequestError(503, "no_endpoints", "no candidate endpoints")
        key = _prefix_key(request, self.prefix_chars)
        ranked = sorted(endpoints, key=lambda e: xxhash.xxh64_intdigest(key, seed=_address_seed(e.address)),
                        reverse=True)
        return SchedulingResult(ranked=ranked[: self.max_endpoints], profile="prefix-hash",
                                context=SchedulingContext.of(request, now))


def _prefix_key(request: InferenceRequest, prefix_chars: int) -> bytes:
    """What the hash baselines hash: the model and the prompt's first `prefix_chars` characters."""
    return f"{request.target_model or request.model}\0{request.prompt_text[:prefix_chars]}".encode(
        "utf-8", "surrogatepass")


class HashRingScheduler(_Stateless):
    """Consistent hashing on a ring with `virtual_nodes` points per pod: the simple router a user tries first.

    The prompt's first `prefix_chars` characters pick a point on the ring; the first pod clockwise serves it, the
    next distinct pods are the fallbacks. Many virtual nodes per pod keep the pods' shares of the key space within
    a few percent of each other, which a plain hash-mod or a few points per pod do not. Reads no metrics."""

    profile_name = "hash-ring"

    def __init__(self, prefix_chars: int = 1000, virtual_nodes: int = 200, max_endpoints: int = 3) -> None:
        if prefix_chars <= 0 or virtual_nodes <= 0:
            raise ValueError("prefix_chars and virtual_nodes must be positive")
        self.prefix_chars = prefix_chars
        self.virtual_nodes = virtual_nodes
        self.max_endpoints = max_endpoints
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

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult:
        if not endpoints:
            raise RequestError(503, "no_endpoints", "no candidate endpoints")
        ranked = self.choose(self.ring_order(request, endpoints))
        return SchedulingResult(ranked=ranked[: self.max_endpoints], profile=self.profile_name,
                                context=SchedulingContext.of(request, now))


class BoundedLoadScheduler(HashRingScheduler):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam; KubeAI's prefix-hash balancing).

    A key goes to the first pod clockwise whose in-flight requests, this one included, stay within
    `ceil(load_factor x (all in-flight + 1) / pods)`; a full pod passes the key to the next. Hot keys overflow to
    the next pods on the ring, always the same ones, so their prefixes get a small stable set of holders. The load
    is the router's own in-flight count: no metrics."""

    profile_name = "bounded-load"

    def __init__(self, prefix_chars: int = 1000, virtual_nodes: int = 200, load_factor: float = 1.25,
                 max_endpoints: int = 3) -> None:
        super().__init__(prefix_chars, virtual_nodes, max_endpoints)
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        self.load_factor = load_factor

    def choose(self, order: list[Endpoint]) -> list[Endpoint]:
        capacity = math.ceil(self.load_factor * (sum(e.in_flight for e in order) + 1) / len(order))
        for i, e in enumerate(order):
            if e.in_flight + 1 <= capacity:
                return [e, *order[:i], *order[i + 1:]]
        return order


@functools.lru_cache(maxsize=4096)
def _address_seed(address: str) -> int:
    """A stable 64-bit seed per endpoint address (rendezvous hashing's per-node salt), hashed once per pod."""
    return xxhash.xxh64_intdigest(address.encode())


class LeastLoadScheduler(PrefixAwareScheduler):
    """Queue + KV-cache scorers only, weights 1:1 (a cache-blind load balancer)."""

    def __init__(self, rng: random.Random | None = None, max_endpoints: int = 3) -> None:
        profile = Profile(
            "least-load",
            scorers=[WeightedScorer(QueueScorer("queue"), 1.0), WeightedScorer(KVCacheUtilizationScorer("kv-cache"), 1.0)],
            picker=MaxScorePicker(max_endpoints=max_endpoints, rng=rng),
        )
        super().__init__([profile])


class PrefixOnlyScheduler(PrefixAwareScheduler):
    """Matched/total prefix ratio only, random among ties (GIE's prefix scorer without load terms)."""

    def __init__(
        self,
        rng: random.Random | None = None,
        max_endpoints: int = 3,
        *,
        index: PrefixIndex | None = None,
        hasher: PrefixHasher | None = None,
    ) -> None:
        scorer = PrefixCacheScorer("prefix", ratio_weight=1.0, load_guard_in_flight=None, load_guard_waiting=None)
        profile = Profile(
            "prefix-only",
            scorers=[WeightedScorer(scorer, 1.0)],
            picker=MaxScorePicker(max_endpoints=max_endpoints, rng=rng),
        )
        super().__init__([profile], index=index, hasher=hasher)

