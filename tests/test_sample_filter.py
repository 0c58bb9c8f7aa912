"""The candidate-sample-filter (in the default profiles): every pod below its threshold; above it, the prefix holders
(the least loaded of them when many), the least loaded pods and a random few, so a decision in a large pool scores
a few dozen pods and routes as if it had scored them all."""

from __future__ import annotations

import random
from collections import Counter

from picker.core.requests import ApiKind, InferenceRequest
from picker.endpoints.state import Endpoint
from picker.scheduling.config import build_scheduler
from picker.scheduling.filters import CandidateSampleFilter
from picker.scheduling.scheduler import PrefixAwareScheduler
from picker_lab.bench.configs import every_pod_scheduling
from tests.test_scheduler import SYSTEM, route
from tests.test_scorers import ctx_for


def pods(n: int) -> list[Endpoint]:
    return [Endpoint.from_address(f"10.1.{i // 250}.{i % 250}:8000") for i in range(n)]


def test_a_small_pool_is_kept_whole() -> None:
    pool = pods(100)
    ctx = ctx_for()
    assert CandidateSampleFilter(min_candidates=256).filter(ctx, pool) is pool
    assert ctx.sampled_from == 0


def test_a_large_pool_keeps_the_holders_the_least_loaded_and_a_random_few() -> None:
    pool = pods(1000)
    for i, e in enumerate(pool):
        e.in_flight = 5 if i % 100 else 1  # ten pods are the least loaded
    ctx = ctx_for(keys=8)
    ctx.matches = {pool[10].address: 8, pool[500].address: 8, pool[700].address: 3}
    kept = CandidateSampleFilter(least_loaded=10, least_recent=0, sample_size=4, rng=random.Random(1)).filter(ctx, pool)
    assert {pool[10], pool[500], pool[700]} <= set(kept)  # every holder, the shorter match too
    assert {pool[i] for i in range(0, 1000, 100)} <= set(kept)
    assert 13 < len(kept) <= 17 and kept == sorted(kept, key=pool.index)  # the pool's order kept
    assert ctx.sampled_from == 1000


def test_of_many_holders_the_least_loaded_are_kept() -> None:
    pool = pods(1000)
    ctx = ctx_for(keys=8)
    ctx.matches = {e.address: 8 for e in pool[:400]}  # a system prompt 400 pods hold
    ctx.matches.update({e.address: 4 for e in pool[400:600]})
    for i, e in enumerate(pool):
        e.in_flight = 3 + i % 7
    pool[50].in_flight = pool[450].in_flight = 0  # the least loaded longest holder, and of any holder
    kept = CandidateSampleFilter(least_loaded=8, least_recent=0, sample_size=0, rng=random.Random(2)).filter(ctx, pool)
    assert pool[50] in kept and pool[450] in kept
    assert len(kept) <= 24


def test_equal_loads_come_out_in_random_order() -> None:
    """Idle pods take turns: the least loaded of equals are not always the same ones."""
    pool = pods(1000)
    sampler = CandidateSampleFilter(least_loaded=16, least_recent=0, sample_size=0, rng=random.Random(3))
    first, second = (set(sampler.filter(ctx_for(), pool)) for _ in range(2))
    assert first != second and len(first) == len(second) == 16


def test_the_pods_picked_longest_ago_are_kept() -> None:
    """Where loads are level, the cold-prefix spreader deals a cold prompt to the pod picked longest ago (its last
    prefill most likely done): those pods are in the sample, not a random few of the equals."""
    pool = pods(1000)
    for i, e in enumerate(pool):
        e.last_picked_at = 100.0 + i % 500  # pods 0 and 500 were picked longest ago, 499 and 999 last
    kept = CandidateSampleFilter(least_loaded=4, least_recent=6, sample_size=0, rng=random.Random(5)).filter(
        ctx_for(), pool)
    assert {pool[0], pool[500], pool[1], pool[501], pool[2], pool[502]} <= set(kept) and len(kept) <= 10


def test_the_defaults_score_a_sample_and_pick_the_least_loaded_pod() -> None:
    scheduler = build_scheduler(rng=random.Random(3))
    pool = pods(300)
    for e in pool:
        e.in_flight = 4
    pool[123].in_flight = 0
    result = scheduler.schedule(InferenceRequest("r", "m", api=ApiKind.COMPLETIONS, prompt_text="x" * 500), pool, 0.0)
    scored = [c for c in result.candidates if c.filtered_by is None]
    assert 40 <= len(scored) <= 56  # the 32 least loaded, the 16 picked longest ago, 8 at random (some twice)
    assert result.ranked[0] is pool[123]


def holders_per_prefix(scheduler: PrefixAwareScheduler) -> float:
    """32 prefixes, one request after another over 300 pods, a third of them finished: the mean number of pods
    each prefix ends up on."""
    pool = pods(300)
    systems = [f"System prompt {g}: " + SYSTEM for g in range(32)]
    homes: dict[int, set[str]] = {}
    flight: list[tuple[Endpoint, int]] = []
    for i in range(900):
        r = InferenceRequest(f"r{i}", "llama", prompt_text=systems[i % 32] + f"Q{i}")
        e = route(scheduler, r, pool, i * 0.01)
        homes.setdefault(i % 32, set()).add(e.address)
        flight.append((e, len(r.prompt_text) // 4))
        if i % 3 == 0:
            done, tokens = flight.pop(0)
            done.finish_request(tokens)
    return sum(len(h) for h in homes.values()) / len(homes)


def test_a_sample_spreads_hot_prefixes_as_scoring_every_pod_does() -> None:
    """Each prefix has a thirty-second of the traffic: over 300 pods that is nine pods' share, so it gets holders by
    load. Shares are of all the candidates, not of the sample (SchedulingContext.sampled_from): counted in a sample
    of ~40, a prefix would look like a pod's share and keep one or two holders while they queue."""
    every = holders_per_prefix(build_scheduler(every_pod_scheduling(), rng=random.Random(4)))
    sampled = holders_per_prefix(build_scheduler(rng=random.Random(4)))
    assert every > 4
    assert abs(sampled - every) <= 0.25 * every, (sampled, every)


def test_every_pod_scheduling_drops_only_the_sample() -> None:
    defaults = build_scheduler()
    every = build_scheduler(every_pod_scheduling())
    for name, profile in defaults.profiles.items():
        assert [f.name for f in profile.filters] == ["candidate-sample-filter", "saturation-filter"]
        assert [f.name for f in every.profiles[name].filters] == ["saturation-filter"]
        assert Counter(w.scorer.name for w in profile.scorers) == Counter(
            w.scorer.name for w in every.profiles[name].scorers)
