"""The opt-in candidate-sample-filter: every pod below its threshold; above it, the longest prefix holders and a
random handful, so a decision in a large pool scores a few dozen pods."""

from __future__ import annotations

import random

from picker.core.requests import ApiKind, InferenceRequest
from picker.endpoints.state import Endpoint
from picker.scheduling.config import build_scheduler, sampled_scheduling
from picker.scheduling.filters import CandidateSampleFilter
from tests.test_scorers import ctx_for


def pods(n: int) -> list[Endpoint]:
    return [Endpoint.from_address(f"10.1.{i // 250}.{i % 250}:8000") for i in range(n)]


def test_a_small_pool_is_kept_whole() -> None:
    pool = pods(100)
    assert CandidateSampleFilter(min_candidates=256).filter(ctx_for(), pool) is pool


def test_a_large_pool_keeps_the_longest_holders_and_a_random_few() -> None:
    pool = pods(1000)
    ctx = ctx_for(keys=8)
    ctx.matches = {pool[10].address: 8, pool[500].address: 8, pool[700].address: 3}
    kept = CandidateSampleFilter(sample_size=16, rng=random.Random(1)).filter(ctx, pool)
    assert pool[10] in kept and pool[500] in kept
    assert 16 < len(kept) <= 18 and kept == sorted(kept, key=pool.index)  # the pool's order kept


def test_many_equal_holders_are_sampled_not_always_the_same_ones() -> None:
    pool = pods(1000)
    ctx = ctx_for(keys=8)
    ctx.matches = {e.address: 8 for e in pool[:400]}  # a system prompt every other pod holds
    sampler = CandidateSampleFilter(sample_size=16, rng=random.Random(2))
    first, second = (set(sampler.filter(ctx, pool)) for _ in range(2))
    assert first != second and len(first) <= 32


def test_the_sampled_defaults_route_a_large_pool() -> None:
    scheduler = build_scheduler(sampled_scheduling(sampleSize=8), rng=random.Random(3))
    pool = pods(300)
    result = scheduler.schedule(InferenceRequest("r", "m", api=ApiKind.COMPLETIONS, prompt_text="x" * 500), pool, 0.0)
    scored = [c for c in result.candidates if c.filtered_by is None]
    assert len(scored) == 8 and result.ranked[0] in pool
