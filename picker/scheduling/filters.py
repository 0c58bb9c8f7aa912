"""Filters: remove candidates that should not get the request. (The subset hint Envoy sends is applied by
the director before scheduling: a pod outside it is never a candidate.)"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.saturation import SaturationThresholds, not_past_full
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import Plugin, PluginDeps, PluginFactory, default_of
from picker.scheduling.scorers import InFlightLoadScorer


class SaturationFilter(Plugin):
    """Drop pods past full (picker.endpoints.saturation: the level admission control reads too) — unless that would
    drop every pod.

    Routing to a saturated pod only adds to its queue; when all are saturated, admission control (not this
    filter) decides who waits or is shed. A pod whose metrics are stale is at "full", not past it: kept.
    """

    type_name = "saturation-filter"

    def __init__(self, name: str | None = None, *, thresholds: SaturationThresholds | None = None) -> None:
        super().__init__(name)
        self.thresholds = thresholds if thresholds is not None else SaturationThresholds()

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        kept = not_past_full(candidates, ctx.now, self.thresholds)
        return kept if kept else candidates


class SaturationFilterParams(Section):
    """Unset thresholds are the admission section's (one definition of a full pod)."""

    queue_threshold: float | None = Field(None, gt=0)
    kv_cache_threshold: float | None = Field(None, gt=0)


def _saturation(name: str, p: SaturationFilterParams, deps: PluginDeps) -> Plugin:
    base = deps.saturation
    thresholds = SaturationThresholds(p.queue_threshold if p.queue_threshold is not None else base.queue,
                                      p.kv_cache_threshold if p.kv_cache_threshold is not None else base.kv_cache,
                                      base.stale)
    return SaturationFilter(name, thresholds=thresholds)


class CandidateSampleFilter(Plugin):
    """In a large pool, score only the pods that can win: those holding the longest match of the prompt's prefix
    (the `least_loaded` least loaded of them, and of any holder, when more do), the `least_loaded` least loaded pods
    of all by our own in-flight count (ties in random order), the `least_recent` we picked longest ago (where a
    cold prompt goes when loads are level: the cold-prefix spreader's choice), and `sample_size` pods drawn at
    random (they bring what only a scrape shows: other replicas' queues, KV use). Below `min_candidates` it keeps
    every pod, so small pools are routed exactly as without it. Scoring is per pod in Python; the pool keeps our
    counts and pick times in numpy columns (picker.endpoints.load_column), so a decision at 4,000 pods costs about
    twice one at 256 (`make scale`). A sample of random pods alone lost the least loaded pod too often (chat TTFT
    p90 1.26x at 256 pods, 1.69x at 1,024 in the simulator); without the pods picked longest ago, cold long prompts
    landed behind recent prefills (shared-prefix TTFT p99 1.17-1.27x over three seeds)."""

    type_name = "candidate-sample-filter"

    def __init__(self, name: str | None = None, *, min_candidates: int = 256, least_loaded: int = 32,
                 least_recent: int = 16, sample_size: int = 8, rng: random.Random | None = None) -> None:
        super().__init__(name)
        if min_candidates < 1 or least_loaded < 1 or least_recent < 0 or sample_size < 0:
            raise ValueError("minCandidates and leastLoaded must be positive, leastRecent and sampleSize not negative")
        self.min_candidates = min_candidates
        self.least_loaded = least_loaded
        self.least_recent = least_recent
        self.sample_size = sample_size
        self.rng = rng if rng is not None else random.Random()
        self._jitter: np.random.Generator | None = None  # random order among equal loads (seeded on first use:
        # a small pool's picks draw the shared rng exactly as without this filter)
        self._for: Sequence[Endpoint] | None = None  # the candidate list `_by_address` indexes (the pool's own)
        self._by_address: dict[str, int] = {}

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        n = len(candidates)
        if n < self.min_candidates:
            return candidates
        k = self.least_loaded
        loads, picked_at = _own_columns(candidates)
        keep: dict[int, None] = {}
        matches = ctx.matches
        if matches:
            if self._for is not candidates:
                self._by_address = {e.address: i for i, e in enumerate(candidates)}
                self._for = candidates
            by_address = self._by_address
            longest = max(matches.values())
            held = [(i, blocks) for address, blocks in matches.items() if (i := by_address.get(address)) is not None]
            if len(held) <= k:
                keep.update(dict.fromkeys(i for i, _ in held))
            else:  # a prefix many pods hold: the least loaded of its longest holders, and of any holder
                keep.update(dict.fromkeys(heapq.nsmallest(k, (i for i, blocks in held if blocks == longest),
                                                          key=loads.item)))
                keep.update(dict.fromkeys(heapq.nsmallest(k, (i for i, _ in held), key=loads.item)))
        if k < n:
            if self._jitter is None:
                self._jitter = np.random.default_rng(self.rng.getrandbits(64))
            # plus a fraction too small to reorder loads: equal ones come out in random order
            keep.update(dict.fromkeys(np.argpartition(loads + self._jitter.random(n) * 1e-6, k)[:k].tolist()))
        else:
            keep.update(dict.fromkeys(range(n)))
        recent = self.least_recent
        if 0 < recent < n:  # what the cold-prefix spreader deals a cold prompt to: the pods we picked longest ago
            keep.update(dict.fromkeys(np.argpartition(picked_at, recent)[:recent].tolist()))
        keep.update(dict.fromkeys(self.rng.sample(range(n), min(self.sample_size, n))))
        ctx.sampled_from = n
        return [candidates[i] for i in sorted(keep)]


_PER_TOKEN = 1.0 / default_of(InFlightLoadScorer, "tokens_per_request")


def _own_columns(candidates: list[Endpoint]) -> tuple[np.ndarray, np.ndarray]:
    """Our own load on each candidate as the in-flight scorer counts it (without recent prefill), and when we last
    picked it: from the pool's columns when the candidates are its ready list (no pass over them in Python), else
    read pod by pod."""
    per = _PER_TOKEN
    column = candidates[0].column
    if column is not None and column.covers(candidates):
        return column.requests + column.tokens * per, column.picked_at
    return (np.array([e.in_flight + e.in_flight_tokens * per for e in candidates], dtype=np.float64),
            np.array([e.last_picked_at for e in candidates], dtype=np.float64))


class CandidateSampleParams(Section):
    min_candidates: int = Field(default_of(CandidateSampleFilter, "min_candidates"), ge=1)
    least_loaded: int = Field(default_of(CandidateSampleFilter, "least_loaded"), ge=1)
    least_recent: int = Field(default_of(CandidateSampleFilter, "least_recent"), ge=0)
    sample_size: int = Field(default_of(CandidateSampleFilter, "sample_size"), ge=0)


def _sample(name: str, p: CandidateSampleParams, deps: PluginDeps) -> Plugin:
    return CandidateSampleFilter(name, **p.model_dump(), rng=deps.rng)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(SaturationFilter.type_name, SaturationFilterParams, _saturation),
    PluginFactory(CandidateSampleFilter.type_name, CandidateSampleParams, _sample),
)
