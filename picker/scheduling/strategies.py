"""Baseline strategies for the benchmark: same Scheduler interface, deliberately simple policies."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import xxhash

from picker.endpoints.state import Endpoint
from picker.prefix.hashing import PrefixHasher
from picker.prefix.index import PrefixIndex
from picker.requests import InferenceRequest, RequestError
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
        key = f"{request.target_model or request.model}\0{request.prompt_text[: self.prefix_chars]}".encode(
            "utf-8", "surrogatepass")
        ranked = sorted(endpoints, key=lambda e: xxhash.xxh64_intdigest(key, seed=_address_seed(e.address)),
                        reverse=True)
        return SchedulingResult(ranked=ranked[: self.max_endpoints], profile="prefix-hash",
                                context=SchedulingContext.of(request, now))


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
