"""The overload scenario's fast twin: the flow controller `picker serve` runs, in simulated time."""

from __future__ import annotations

import math
from pathlib import Path

from picker_lab.bench.fast import run_fast
from picker_lab.bench.overload import (
    FLOW_CONFIG,
    MIX,
    OBJECTIVES,
    TENANTS,
    TIME_SCALE,
    OverloadSpec,
    admission_section,
    fast_capacity,
    fast_config,
    fast_shots,
    fast_trace,
    run_overload,
)
from picker_lab.bench.results import OK, SHED

SEQS = 4  # sequences per pod: a pod queues early


def test_fast_flow_control_queues_orders_refuses_and_expires() -> None:
    """At 2x capacity: sheddable requests refused at once (429), queued ones served critical first or refused
    with 503 once their TTL passes (never later), nothing unanswered; without flow control nothing waits in the
    picker and the pods' queues grow."""
    cap = fast_capacity(2, seed=3, requests=120, max_num_seqs=SEQS)
    trace = fast_trace(2.0 * cap, 12.0, MIX, seed=3)
    flow = fast_shots(trace, FLOW_CONFIG, 2, seed=3, max_num_seqs=SEQS)
    ttl = admission_section(FLOW_CONFIG).flow_control.queue_ttl
    assert {s.status for s in flow} == {200, 429, 503}
    assert all(s.kind == "sheddable" and s.done == s.sent for s in flow if s.status == 429)
    expired = [s.done - s.sent for s in flow if s.status == 503 and s.done is not None]
    assert expired and all(math.isclose(w, ttl, rel_tol=1e-6) for w in expired)
    assert not [s for s in flow if s.status == -1]

    def p90(shots: list, kind: str) -> float:
        waits = sorted(s.first - s.sent for s in shots if s.kind == kind and s.first is not None)
        return waits[int(0.9 * len(waits))]
    assert p90(flow, "critical") < p90(flow, "standard") / 2
    plain = fast_shots(trace, OBJECTIVES, 2, seed=3, max_num_seqs=SEQS)
    assert {s.status for s in plain} <= {200, 429}
    assert p90(flow, "critical") < 0.75 * p90(plain, "critical")


def test_fast_flow_control_shares_between_tenants() -> None:
    """Two tenants at 10:1, both backlogged: served alike with flow control, by offered load without."""
    cap = fast_capacity(2, seed=4, requests=120, max_num_seqs=SEQS)
    trace = fast_trace(6.6 * cap, 20.0, TENANTS, seed=4)

    def served(config: str) -> tuple[int, int]:
        shots = fast_shots(trace, config, 2, seed=4, max_num_seqs=SEQS)
        done = [s for s in shots if s.status == 200 and s.done is not None and 5.0 <= s.done - shots[0].sent <= 18.0]
        return (sum(1 for s in done if s.tenant == "tenant-a"), sum(1 for s in done if s.tenant == "tenant-b"))
    a, b = served(FLOW_CONFIG)
    assert b > 0 and 0.9 <= a / b <= 1.1
    a, b = served(OBJECTIVES)
    assert a > 3 * b


def test_fast_mode_without_flow_control_is_unchanged_by_priorities() -> None:
    """Objectives alone (no flow control) shed nothing below saturation: every request of a light trace served."""
    cap = fast_capacity(2, seed=5, requests=60, max_num_seqs=SEQS)
    trace = fast_trace(0.3 * cap, 10.0, MIX, seed=5)
    res = run_fast(trace, "picker", fast_config(2, admission_section(OBJECTIVES), seed=5, max_num_seqs=SEQS))
    assert all(s == OK for s in res.status) and SHED not in res.status
    assert res.duration_s < 12.0 * TIME_SCALE  # model time: the trace's 10 s at half speed plus the last answers


def test_overload_report_in_both_files(tmp_path: Path) -> None:
    spec = OverloadSpec(phase_s=8.0, pickers=("flow-control", "flow-control-slots-half-known", "default-admission"),
                        seed=2, repeats=2, max_num_seqs=SEQS)
    results = run_overload(spec, ("fast",), tmp_path)
    fast = results["fast"]
    assert set(fast) >= {"capacity_rps", "flow-control", "default-admission"}
    assert set(fast["flow-control"]) == {"nominal", "overload", "tenants"}
    assert fast["flow-control"]["overload"]["hung_or_timed_out"] == 0
    assert fast["flow-control"]["nominal"]["requests"] < fast["flow-control"]["overload"]["requests"]
    report = (tmp_path / "overload.md").read_text()
    assert "| flow-control | overload |" in report and "default-admission" in report
    assert (tmp_path / "overload.json").exists()
    assert fast["seeds"]["flow-control"]["seed"] == [2, 3]
    assert "Over 2 seeds" in report
    assert "maxRunningPerPod: 4}" in {c.name: c.config for c in spec.chosen()}["flow-control-slots-half-known"]


def test_four_replicas_share_tenants_fairly_only_when_they_share_their_load() -> None:
    """Two tenants at 10:1 over four replicas, both backlogged: replicas that count only their own requests each
    let through what they think the pool has room for, the pods' queues decide, and the heavy tenant gets more;
    sharing the in-flight counts keeps the queueing in the pickers, where turns are fair."""
    spec = OverloadSpec(pickers=("flow-control",), replicas=4)
    own, shared = spec.chosen()
    assert (own.replicas, own.load_sync_s, shared.load_sync_s) == (4, 0.0, 0.05)
    assert own.name == "flow-control, 4 replicas, own counts" and shared.name.endswith("shared load")
    cap = fast_capacity(2, seed=4, requests=120)
    trace = fast_trace(6.6 * cap, 20.0, TENANTS, seed=4)

    def ratio(load_sync_s: float) -> float:
        shots = fast_shots(trace, FLOW_CONFIG, 2, seed=4, replicas=4, load_sync_s=load_sync_s)
        done = [s for s in shots if s.status == 200 and s.done is not None and 5.0 <= s.done - shots[0].sent <= 18.0]
        return sum(1 for s in done if s.tenant == "tenant-b") / sum(1 for s in done if s.tenant == "tenant-a")
    assert ratio(0.05) >= 0.9
    assert ratio(0.0) < 0.5
