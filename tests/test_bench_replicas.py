"""Fast mode with several picker replicas behind Envoy: one replica is the single-scheduler run, a shared prefix
index recovers the hits that per-replica indexes lose, every request completes and releases its in-flight count."""

from __future__ import annotations

import math

import pytest

from picker.bench.capacity import cost_per_request, rate_for_load
from picker.bench.fast import FastConfig, _FastRun, run_fast
from picker.bench.results import OK, RunResult
from picker.bench.summary import summarize
from picker.bench.trace import Trace
from picker.bench.workloads import FleetSpec, generate
from picker.sim.profiles import get_profile

PODS = 4
N = 240


@pytest.fixture(scope="module")
def trace() -> Trace:
    """shared-prefix with 20 groups (12 requests each) at load 0.8 of 4 pods."""
    fleet = FleetSpec(get_profile("llama3-8b-h100"), PODS)
    params = {"num_groups": 20}
    rate = rate_for_load(0.8, PODS, cost_per_request("shared-prefix", fleet, 1, params))
    return generate("shared-prefix", N, rate, 1, fleet, **params)


def _cfg(replicas: int = 1, shared_index: bool = False) -> FastConfig:
    return FastConfig(get_profile("llama3-8b-h100"), PODS, seed=1, replicas=replicas, shared_index=shared_index)


def _routing(res: RunResult) -> tuple[list[int], list[float]]:
    return list(res.pod), [round(t, 9) if not math.isnan(t) else -1.0 for t in res.ttft]


def test_one_replica_is_the_single_scheduler_run(trace: Trace) -> None:
    for strategy in ("picker", "prefix-only"):
        single = run_fast(trace, strategy, _cfg())
        for shared in (False, True):
            res = run_fast(trace, strategy, _cfg(replicas=1, shared_index=shared))
            assert _routing(res) == _routing(single), (strategy, shared)
            a, b = summarize(res), summarize(single)
            assert {k: v for k, v in a.items() if k != "wall_s"} == {k: v for k, v in b.items() if k != "wall_s"}


def test_shared_index_recovers_the_hits_of_one_replica(trace: Trace) -> None:
    one = summarize(run_fast(trace, "picker", _cfg()))
    own = summarize(run_fast(trace, "picker", _cfg(replicas=4)))
    shared = summarize(run_fast(trace, "picker", _cfg(replicas=4, shared_index=True)))
    for figures in (one, own, shared):
        assert figures["completed"] == N
    # Own indexes: each replica meets each group's prefix cold once (and may send it elsewhere); shared: once in all.
    assert shared["hit_rate"] > own["hit_rate"] + 0.08
    assert shared["hit_rate"] >= one["hit_rate"] - 0.02


def test_every_replica_routes_and_releases_its_in_flight_counts(trace: Trace) -> None:
    for shared in (False, True):
        run = _FastRun(trace, "picker", _cfg(replicas=4, shared_index=shared), None, None)
        res = run.run()
        assert all(s == OK for s in res.status)
        assert len(run.replica_endpoints) == 4
        for endpoints in run.replica_endpoints:
            assert any(ep.last_picked_at >= 0 for ep in endpoints), "round-robin over replicas reaches each one"
            assert [(ep.in_flight, ep.in_flight_tokens) for ep in endpoints] == [(0, 0)] * PODS
        assert len(run.schedulers) == 4 and len({id(s) for s in run.schedulers}) == 4
