"""Fast mode with several picker replicas behind Envoy: one replica is the single-scheduler run, a shared prefix
index recovers the hits that per-replica indexes lose, every request completes and releases its in-flight count."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from picker_lab.bench.capacity import cost_per_request, rate_for_load
from picker_lab.bench.fast import ExactCacheIndex, FastConfig, _FastRun, run_fast
from picker_lab.bench.results import OK, RunResult
from picker_lab.bench.summary import summarize
from picker_lab.bench.trace import Trace
from picker_lab.bench.workloads import FleetSpec, generate
from picker_lab.sim.engine import Engine, SimRequest
from picker_lab.sim.profiles import get_profile

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
        assert len(run.directors) == 4 and len({id(d.scheduler) for d in run.directors}) == 4


def test_the_exact_cache_view_reads_what_each_pod_holds_now() -> None:
    """bench/exact_index.py's bound of KV-event routing: matches come from the engines' caches, evictions included."""
    profile = get_profile("tiny-cpu")
    engines = [Engine(profile, seed=1), Engine(profile, seed=1)]
    index = ExactCacheIndex(engines, ["10.0.0.1:8000", "10.0.0.2:8000"])
    ids = list(range(1, 4 * profile.block_size + 2))  # 4 full blocks and a bit
    engines[1].add_request(SimRequest("r", ids, 1, ignore_eos=True), 0.0)
    now = 0.0
    while engines[1].has_work():
        now = max(now, engines[1].next_step_time() or now)
        now = engines[1].step(now).end
    block_chars = 4 * profile.block_size
    index.prepare(ids, 4 * len(ids), block_chars)  # 4 characters per token, as the simulator's tokenizer
    keys = list(range(len(ids) * 4 // block_chars + 1))
    assert index.match(keys, None, now) == {"10.0.0.2:8000": 4}
    assert index.match(keys, ["10.0.0.1:8000"], now) == {}
    engines[1].reset_prefix_cache()  # a cache reset is seen at once: no stale affinity
    assert index.match(keys, None, now) == {}


def test_exact_cache_view_runs_the_same_trace(trace: Trace) -> None:
    exact = summarize(run_fast(trace, "picker", FastConfig(get_profile("llama3-8b-h100"), PODS, seed=1,
                                                           exact_index=True)))
    assert exact["completed"] == N and exact["hit_rate"] > summarize(run_fast(trace, "round-robin", _cfg()))["hit_rate"]


def test_kv_events_give_two_replicas_with_own_indexes_the_hits_of_one(trace: Trace) -> None:
    """Fast mode's precise view (the pods' KV events): two replicas that each follow every pod's events route as
    well as one that sees everything, where their own approximate indexes lose hits; with events and nothing
    wrong, precise routing is the approximate one."""
    one = summarize(run_fast(trace, "picker", _cfg()))
    own = summarize(run_fast(trace, "picker", _cfg(replicas=2)))
    precise = FastConfig(get_profile("llama3-8b-h100"), PODS, seed=1, replicas=2, precise=True)
    both = summarize(run_fast(trace, "picker", precise))
    assert own["hit_rate"] < one["hit_rate"] - 0.05
    assert both["hit_rate"] >= one["hit_rate"] - 0.01 and both["completed"] == N
    alone = summarize(run_fast(trace, "picker", FastConfig(get_profile("llama3-8b-h100"), PODS, seed=1,
                                                           precise=True)))
    assert alone["hit_rate"] == pytest.approx(one["hit_rate"], abs=0.01)


def test_bypassed_requests_reach_a_pod_without_the_picker(trace: Trace) -> None:
    cfg = FastConfig(get_profile("llama3-8b-h100"), PODS, seed=1, bypass=0.3)
    res = run_fast(trace, "picker", cfg)
    assert 0.2 * N < len(res.bypassed) < 0.4 * N
    assert all(res.status[i] == OK for i in range(N)) and all(res.pod[i] >= 0 for i in res.bypassed)


def test_a_pod_leaves_the_pool_and_rejoins_empty(trace: Trace) -> None:
    """What bench-real's leave-rejoin does, in fast mode: nothing is sent to the last pod while it is out, and once
    back (cache emptied) it is sent work again, under every router that reads the pool."""
    span = trace.requests[-1].at
    leave, rejoin = 0.3 * span, 0.6 * span
    for strategy in ("hash-ring", "bounded-load", "picker"):
        res = run_fast(trace, strategy, replace(_cfg(), leave_rejoin=(leave, rejoin)))
        gone = [p for p, t in zip(res.pod, res.sent, strict=True) if leave <= t < rejoin]
        after = [p for p, t in zip(res.pod, res.sent, strict=True) if t >= rejoin]
        assert PODS - 1 not in gone and gone, strategy
        assert PODS - 1 in after and all(status == OK for status in res.status), strategy


def test_a_restarted_pods_empty_cache_is_seen_through_its_events(trace: Trace) -> None:
    """KV events bring the precise view to the pods' real caches (the exact bound) through restarts. Not above the
    approximate index: the stale index sends a restarted pod its old prefixes back because it believes the pod
    still holds them, the precise view because the pod is their home, so the two are level
    (docs/scheduling.md, "Where the approximate index is wrong")."""
    restarting = FastConfig(get_profile("llama3-8b-h100"), PODS, seed=1, restart_every=2.0)
    approximate = summarize(run_fast(trace, "picker", restarting))
    precise = summarize(run_fast(trace, "picker", replace(restarting, precise=True)))
    exact = summarize(run_fast(trace, "picker", replace(restarting, exact_index=True)))
    calm = summarize(run_fast(trace, "picker", _cfg()))
    assert approximate["hit_rate"] < calm["hit_rate"]  # restarts cost hits
    assert abs(precise["hit_rate"] - exact["hit_rate"]) <= 0.01 and precise["completed"] == N
    # Here the approximate index is right as often as the exact view, so the lines above cannot tell a precise view
    # that follows the events from one that ignores them. With 40 % of the traffic routed around the picker as
    # well, the index is wrong and only the events keep the view right through the restarts. (At 30 % the gap is
    # 1.3 points of hits and 0.99x the TTFT since the cold-prompt deal counts prefill work: too close
    # to this short trace's noise to tell the views apart.)
    unseen = replace(restarting, bypass=0.4)
    approximate = summarize(run_fast(trace, "picker", unseen))
    precise = summarize(run_fast(trace, "picker", replace(unseen, precise=True)))
    exact = summarize(run_fast(trace, "picker", replace(unseen, exact_index=True)))
    assert abs(precise["hit_rate"] - exact["hit_rate"]) <= 0.005 < exact["hit_rate"] - approximate["hit_rate"] - 0.01
    assert precise["ttft_mean"] < 0.9 * approximate["ttft_mean"]
