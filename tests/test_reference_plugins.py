"""The reference picker's plugins we had no twin for, each against the behaviour its documentation gives."""

from __future__ import annotations

import random
from collections import Counter

from picker.endpoints.state import Endpoint
from picker.scheduling.disagg import DecodeFilter
from picker.scheduling.picker import WeightedRandomPicker
from picker.scheduling.reference_plugins import (
    ActiveRequestScorer,
    LoadAwareScorer,
    NoHitLRUScorer,
    RunningRequestsSizeScorer,
)
from tests.test_scorers import ctx_for, ep


def test_running_requests_and_load_aware_scores() -> None:
    pods = [ep(1, running=0), ep(2, running=4), ep(3, running=8)]
    assert RunningRequestsSizeScorer().score(ctx_for(), pods) == [1.0, 0.5, 0.0]
    queued = [ep(1, waiting=0), ep(2, waiting=64), ep(3, waiting=500)]
    assert LoadAwareScorer(threshold=128).score(ctx_for(), queued) == [0.5, 0.25, 0.0]  # absolute, capped


def test_active_request_scorer_treats_idle_pods_alike_and_scales_busy_ones() -> None:
    pods = [ep(i) for i in range(4)]
    for pod, in_flight in zip(pods, (0, 1, 2, 4), strict=True):
        pod.in_flight = in_flight
    assert ActiveRequestScorer(idle_threshold=1, max_busy_score=0.8).score(ctx_for(), pods) == [1.0, 1.0, 0.4, 0.0]
    for pod in pods:
        pod.in_flight = 0
    assert ActiveRequestScorer().score(ctx_for(), pods) == [1.0] * 4


def test_no_hit_lru_spreads_cold_prompts_and_is_neutral_on_hits() -> None:
    scorer = NoHitLRUScorer(lru_size=8)
    pods = [ep(1), ep(2), ep(3)]
    cold = ctx_for(keys=2, matched=[0, 0, 0])
    assert scorer.score(cold, pods) == [1.0, 0.5, 0.0]  # none used yet: in order
    scorer.on_picked(cold, pods[0], 0.0)
    scorer.on_picked(cold, pods[1], 0.0)
    assert scorer.score(cold, pods) == [0.5, 0.0, 1.0]  # never used first, then least recently used
    warm = ctx_for(keys=2, matched=[2, 0, 0])
    warm.matches = {pods[0].address: 2}
    assert scorer.score(warm, pods) == [0.5, 0.5, 0.5]
    scorer.on_picked(warm, pods[2], 0.0)  # a warm pick teaches it nothing
    assert scorer.score(cold, pods) == [0.5, 0.0, 1.0]
    scorer.on_endpoint_removed(pods[0])
    assert scorer.score(cold, pods) == [1.0, 0.0, 0.5]


def test_decode_filter_keeps_decoders_and_unlabelled_pods() -> None:
    plain = [ep(1), ep(2)]
    assert DecodeFilter().filter(ctx_for(), plain) == plain  # a pool without roles
    roles = [Endpoint.from_address(f"10.0.1.{i}:8000", labels={"llm-d.ai/role": role} if role else {})
             for i, role in enumerate(("prefill", "decode", "both", ""))]
    assert [e.labels.get("llm-d.ai/role", "") for e in DecodeFilter().filter(ctx_for(), roles)] == \
        ["decode", "both", ""]


def test_weighted_random_picker_draws_in_proportion_and_never_repeats() -> None:
    picker = WeightedRandomPicker(max_endpoints=1, rng=random.Random(3))
    firsts = Counter(picker.pick([3.0, 1.0, 0.0])[0] for _ in range(4000))
    assert firsts[2] == 0 and 0.70 < firsts[0] / 4000 < 0.80  # 3:1, zero never drawn first
    ranked = WeightedRandomPicker(max_endpoints=3, rng=random.Random(1)).pick([1.0, 2.0, 0.0])
    assert sorted(ranked) == [0, 1, 2] and ranked[-1] == 2
    assert sorted(WeightedRandomPicker(max_endpoints=2, rng=random.Random(1)).pick([0.0, 0.0, 0.0])) in \
        ([0, 1], [0, 2], [1, 2])
