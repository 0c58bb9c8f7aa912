"""The real-engine benchmark's own logic (trace, figures, targets, report); the run itself needs vLLM: make bench-real."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, replace
from typing import Any

import pytest
from prometheus_client import generate_latest

from picker.endpoints.state import Endpoint
from picker.serving.metrics import PickerMetrics
from picker_lab.bench.real import DETAIL_COLUMNS, replay, run_real
from picker_lab.bench.real_analysis import (
    busier_pick_lines,
    cold_causes,
    cold_kinds,
    cross_pod_lines,
    cross_pod_warm,
    first_placement_lines,
    first_placements,
    mean_without_avoidable_colds,
    paired_ratio_lines,
    request_rows,
    routing_cost_lines,
    ttft_breakdown,
    where_ttft_goes,
)
from picker_lab.bench.real_figures import combine, medians, targets
from picker_lab.bench.real_mirror import (
    RouterPath,
    direction_check,
    machine_slowdown,
    mirror_at_rates,
    mirror_overshoots,
    router_paths,
    sim_mirror,
)
from picker_lab.bench.real_render import report
from picker_lab.bench.real_routers import picker_flags, scrapes_per_pod
from picker_lab.bench.real_spec import RealSpec, build_trace, chains
from picker_lab.supervisor import process_scope, start_backends


def run(strategy: str, repeat: int, hit: float, mean: float, p90: float, share: float, scrapes: float) -> dict:
    return {"strategy": strategy, "repeat": repeat, "hit_rate": hit, "ttft_mean_ms": mean, "ttft_p50_ms": mean / 2,
            "ttft_p90_ms": p90, "ttft_p99_ms": p90 * 2, "failed": 0, "share": [share, 1 - share],
            "server_cpu_share": [0.5, 0.5], "api_server_cpu_share": [0.01, 0.01],
            "metrics_requests_per_pod_per_s": [scrapes, scrapes], "warm_share": hit,
            "ttft_warm_p50_ms": 20.0, "ttft_cold_p50_ms": 60.0, "groups_per_pod": [3, 2],
            "cold_causes": {"first": 5, "copy": 1, "evicted": 2}}


def answered(sent: float, group: int, pod: str, cached: int, prompt: int = 100) -> dict:
    return {"sent": sent, "first_chunk": sent + 0.05, "status": 200, "group": group, "pod": pod,
            "usage": {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}}


def test_trace_is_inference_perf_shared_prefix_shaped() -> None:
    spec = RealSpec(groups=5, prompts_per_group=4, system_tokens=100, question_tokens=10, rate=4.0, seed=3)
    trace = build_trace(spec, tokens_per_word=2.0)
    assert len(trace) == 20 and Counter(r.group for r in trace) == dict.fromkeys(range(5), 4)
    assert all(a.at < b.at for a, b in zip(trace, trace[1:], strict=False))
    by_group: dict[int, set[str]] = {}
    for r in trace:
        by_group.setdefault(r.group, set()).add(r.prompt.split("\n\nQuestion:")[0])
    assert all(len(systems) == 1 for systems in by_group.values())  # one shared system prompt per group
    assert len({next(iter(v)) for v in by_group.values()}) == 5
    assert len(next(iter(by_group[0])).split()) == 50  # 100 tokens at 2 tokens per word
    assert [r.prompt for r in build_trace(spec, 2.0)] == [r.prompt for r in trace]  # seeded
    assert [r.prompt for r in build_trace(spec, 2.0, repeat=2)] == [r.prompt for r in trace]  # one trace for all


def test_reused_servers_replay_a_new_trace_each_repeat() -> None:
    """Reused servers keep their ports, so a hash router would place one trace's prefixes the same way in every
    repeat: with seed_per_repeat repeat r replays seed + r's trace, and settling passes (r < 0) repeat 0's."""
    spec = RealSpec(groups=5, prompts_per_group=4, system_tokens=100, question_tokens=10, seed=3,
                    seed_per_repeat=True)
    assert [spec.trace_seed(r) for r in (-2, 0, 1, 4)] == [3, 3, 4, 7]
    first, second = (build_trace(spec, 2.0, repeat=r) for r in (0, 1))
    assert [r.prompt for r in first] == [r.prompt for r in build_trace(replace(spec, seed_per_repeat=False), 2.0)]
    assert not {r.prompt.split("\n\n")[0] for r in first} & {r.prompt.split("\n\n")[0] for r in second}
    assert [r.prompt for r in build_trace(spec, 2.0, repeat=-1)] == [r.prompt for r in first]


def test_reused_servers_from_the_command_line_replay_a_trace_per_repeat() -> None:
    import argparse

    from picker_lab.bench.cli import add_arguments, real_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    reused = real_spec(parser.parse_args(["--engine", "vllm", "--workload", "hot", "--reuse-servers", "--seed", "4"]))
    assert reused.reuse_servers and reused.seed_per_repeat and reused.trace_seed(2) == 6
    fresh = real_spec(parser.parse_args(["--engine", "vllm", "--workload", "hot", "--requests", "300"]))
    assert not fresh.reuse_servers and not fresh.seed_per_repeat and fresh.trace_seed(2) == 1
    assert fresh.requests == 300


def test_busier_picks_count_requests_sent_to_the_pod_with_more_prefills_in_progress() -> None:
    from picker_lab.bench.real_analysis import busier_picks

    rows = [[0.0, 0, 0, 100, 0, 500.0],  # pod 0 prefilling until 0.5 s
            [0.1, 0, 0, 100, 90, 100.0],  # onto pod 0 while it prefills and pod 1 is idle: busier
            [0.3, 1, 1, 100, 0, 100.0],  # pod 1: one waiting on pod 0, none on pod 1
            [0.6, 1, 0, 100, 90, 50.0],  # both clear: not busier
            [0.61, 1, -1, 100, 90, 50.0]]  # unknown pod: not counted
    assert busier_picks(rows) == (4, 1)


def test_routing_cost_section_gives_each_routers_median_hold_and_cpu() -> None:
    from picker_lab.bench.real_analysis import routing_cost_lines

    runs = [{**run("round-robin", i, 0.8, 100, 200, 0.5, 0.0), "request_held_ms": [0.3 + i / 10, 0.6],
             "response_held_ms": [0.1, 0.2], "router_cpu_share": 0.02, "server_cpu_share": [0.96, 0.98]}
            for i in range(3)]
    runs += [{**run("picker", i, 0.8, 100, 200, 0.5, 1.0), "request_held_ms": [2.5, 4.0 + i],
              "response_held_ms": [0.6, 0.8], "router_cpu_share": 0.06 + i / 100, "server_cpu_share": [0.92, 0.94]}
             for i in range(3)]
    runs.append(run("hash-ring", 0, 0.8, 100, 200, 0.5, 0.0))  # recorded before Envoy timed requests: no row
    lines = routing_cost_lines(runs, medians(runs, ("round-robin", "hash-ring", "picker")))
    assert "| round-robin | 0.40 / 0.60 | 0.10 / 0.20 | 0.020 | 0.970 |" in lines
    assert "| picker | 2.50 / 5.00 | 0.60 / 0.80 | 0.070 | 0.930 |" in lines
    assert not any(line.startswith("| hash-ring") for line in lines)
    assert routing_cost_lines(runs[-1:], medians(runs[-1:], ("hash-ring",))) == []


def test_paired_ratios_compare_each_repeat_with_round_robins_own() -> None:
    from picker_lab.bench.real_analysis import paired_ratio_lines

    runs = [run("round-robin", i, 0.8, mean, 2 * mean, 0.5, 0.0) for i, mean in enumerate((100, 300, 200))]
    runs += [run("picker", i, 0.8, mean, 2 * mean, 0.5, 1.0) for i, mean in enumerate((110, 240, 200))]
    runs.append({"strategy": "picker", "repeat": 3, "error": "vLLM exited with 1"})  # failed: not paired
    lines = paired_ratio_lines(runs, ["round-robin", "picker"])
    # 1.10, 0.80, 1.00 repeat by repeat, where the ratio of the medians (200 / 200) would say 1.00
    assert "| picker | 3 | 1.00x (0.80-1.10) | 1.00x (0.80-1.10) |" in lines
    against_baseline = lines[: lines.index("## The picker against each router, repeat by repeat")]
    assert not any(line.startswith("| round-robin") for line in against_baseline)
    assert paired_ratio_lines(runs[3:], ["picker"]) == []  # nothing to pair with


def test_the_picker_is_paired_with_every_other_router_repeat_by_repeat() -> None:
    runs = [run("hash-ring", i, 0.8, mean, 2 * mean, 0.5, 0.2) for i, mean in enumerate((200, 100, 300))]
    runs += [run("sglang-router", i, 0.8, mean, 2 * mean, 0.5, 0.0) for i, mean in enumerate((150, 120, 250))]
    runs += [run("picker", i, 0.8, mean, 2 * mean, 0.5, 1.0) for i, mean in enumerate((120, 132, 200))]
    lines = paired_ratio_lines(runs, ["hash-ring", "sglang-router", "picker"])
    section = lines[lines.index("## The picker against each router, repeat by repeat"):]
    # against sglang-router: 0.80, 1.10, 0.80 -> median 0.80, lower in 2 of 3
    assert "| sglang-router | 3 | 0.80x (0.80-1.10) | 0.80x (0.80-1.10) | 2 / 2 |" in section
    assert "| hash-ring | 3 | 0.67x (0.60-1.32) | 0.67x (0.60-1.32) | 2 / 2 |" in section
    assert not any(line.startswith("| picker") for line in section)


def test_medians_targets_and_report() -> None:
    runs = [run("round-robin", i, 0.44, 90 + i, 160, 0.5, 0.0) for i in range(3)]
    runs += [run("hash-ring", i, 0.80, 46 + i, 114, 0.6, 0.2) for i in range(3)]
    runs += [run("bounded-load", i, 0.84, 50 + i, 104, 0.55, 0.2) for i in range(3)]
    runs += [run("picker", i, 0.83, 40 + i, 120, 0.55, 1.0) for i in range(3)]
    runs += [run("picker-4-replicas", i, 0.83, 41, 100, 0.55, 1.0 + i) for i in range(3)]
    runs.append({"strategy": "picker", "repeat": 3, "error": "vLLM exited with 1"})
    m = medians(runs, ("round-robin", "hash-ring", "bounded-load", "picker", "picker-4-replicas"))
    assert m["picker"]["ttft_mean_ms"] == 41 and m["picker"]["runs"] == 3
    assert m["picker"]["ttft_mean_ms_range"] == [40, 42] and m["picker"]["ttft_p90_ms_range"] == [120, 120]
    assert m["picker-4-replicas"]["metrics_requests_per_pod_per_s"] == 2.0
    targets_of = {t["target"]: t for t in targets(m, "uniform")}
    met = {name: t["met"] for name, t in targets_of.items()}
    # each figure against the better hash baseline for it: mean vs hash-ring's 47, p90 vs bounded-load's 104
    assert met["picker TTFT mean <= 1x the better hash baseline's"]
    assert not met["picker TTFT p90 <= 1x the better hash baseline's"]
    assert "bounded-load 104.0" in targets_of["picker TTFT p90 <= 1x the better hash baseline's"]["measured"]
    assert not met["picker hit rate >= the better hash baseline's"]  # 0.83 vs bounded-load's 0.84
    assert not met["/metrics requests per pod per s at 4 replicas <= at 1 replica (within 5 %)"]  # 2.0 > 1.0
    hot = {t["target"]: t["met"] for t in targets(m, "hot")}
    assert not hot["picker TTFT mean <= 0.85x the better hash baseline's"]  # 41 > 0.85 x 47
    assert hot["picker TTFT mean <= round-robin's"] and hot["picker TTFT p90 <= round-robin's"]
    assert "picker hit rate >= the better hash baseline's" not in hot  # every router is warm there


def test_workloads_are_named_specs() -> None:
    hot = RealSpec.for_workload("hot", repeats=1)
    assert (hot.workload, hot.groups, hot.requests, hot.repeats) == ("hot", 4, 240, 1)
    assert RealSpec.for_workload("uniform") == RealSpec()
    assert RealSpec.for_workload("pressure", rate=3.0).rate == 3.0
    with pytest.raises(ValueError, match="unknown workload 'bogus'"):
        RealSpec.for_workload("bogus")
    leave = RealSpec.for_workload("leave-rejoin")
    assert leave.strategies == ("hash-ring", "bounded-load", "picker") and 0 < leave.leave_at < leave.rejoin_at < 1
    assert RealSpec.for_workload("leave-rejoin", strategies=("picker",)).strategies == ("picker",)


def test_a_recorded_run_says_whether_its_scrapes_asked_for_only_the_series_read() -> None:
    """Runs since the series filter record it (the mirror prices their scrapes lower); a run recorded before it
    scraped whole pages."""
    now = asdict(RealSpec.for_workload("hot"))
    assert now["series_filter"] and RealSpec.recorded(now).series_filter
    before = {k: v for k, v in now.items() if k != "series_filter"}
    assert not RealSpec.recorded(before).series_filter


def test_a_pod_leaving_is_refused_where_a_router_cannot_follow_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Checked before anything is installed or started."""
    with pytest.raises(ValueError, match=r"round-robin's Envoy routes over a static list of servers"):
        run_real(RealSpec.for_workload("leave-rejoin", strategies=("round-robin", "picker")), tmp_path)
    with pytest.raises(ValueError, match="0 < leave_at < rejoin_at < 1"):
        run_real(RealSpec.for_workload("leave-rejoin", rejoin_at=0.2), tmp_path)


def test_replicated_routers_are_named_name_at_n_and_checked_before_anything_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad, why in (("picker@0", "the count after @"), ("smg-mesh@2x", "the count after @"),
                     ("vllm-router-mesh@2", "vllm-router has no mesh"), ("round-robin@2", "unknown strategy"),
                     ("fastest@2", "unknown strategy")):
        with pytest.raises(ValueError, match=why):
            run_real(RealSpec.for_workload("uniform", strategies=("picker", bad)), tmp_path)
    with pytest.raises(ValueError, match="replicated peers are not measured with a pod leaving"):
        run_real(RealSpec.for_workload("leave-rejoin", strategies=("picker", "smg@2")), tmp_path)


def test_replicas_of_the_picker_share_a_valkey_and_of_a_hash_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from picker_lab.bench.real_routers import start_router
    from picker_lab.supervisor import process_scope, start_backends

    with process_scope("real-replicas") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        for strategy, valkey in (("picker@2", True), ("hash-ring@2", False)):
            router = start_router(strategy, RealSpec(), backends.addresses, logdir)
            started.extend(router.processes)
            names = [p.name for p in router.processes]
            assert len(router.metrics_ports) == 2 and router.through_envoy, names
            assert any(n.startswith("valkey") for n in names) == valkey, names


def test_a_candidate_is_the_picker_with_its_own_flags_on_top(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`picker-candidate` runs the picker with `--candidate-args` after `--picker-args`; each without the other is
    refused before anything is installed or started."""
    spec = RealSpec(strategies=("picker", "picker-candidate"), picker_args=("--log-level", "INFO"),
                    candidate_args=("--config-file", "variant.yaml"))
    assert picker_flags("picker", spec, tmp_path) == ["--log-level", "WARNING", "--log-level", "INFO"]
    assert picker_flags("picker-candidate", spec, tmp_path) == ["--log-level", "WARNING", "--log-level", "INFO",
                                                                "--config-file", "variant.yaml"]
    for lone in (replace(spec, candidate_args=()), replace(spec, strategies=("picker",))):
        with pytest.raises(ValueError, match="--candidate-args and the picker-candidate strategy go together"):
            run_real(lone, tmp_path)


def test_direction_check_and_report() -> None:
    real = {"a": {"hit_rate": 0.4, "ttft_mean_ms": 90.0, "ttft_p90_ms": 150.0},
            "b": {"hit_rate": 0.8, "ttft_mean_ms": 40.0, "ttft_p90_ms": 100.0}}
    sim = {"a": {"hit_rate": 0.5, "ttft_mean_ms": 60.0, "ttft_p90_ms": 90.0},
           "b": {"hit_rate": 0.8, "ttft_mean_ms": 30.0, "ttft_p90_ms": 95.0}}
    rows = direction_check(real, sim)
    assert [(r["figure"], r["agree"]) for r in rows] == [("hit_rate", True), ("ttft_mean_ms", True),
                                                         ("ttft_p90_ms", False)]  # sim: level (90 vs 95)
    sim["b"]["hit_rate"] = 0.505  # level in the simulator, 0.4 apart on real servers
    assert not direction_check(real, sim)[0]["agree"]
    real["b"]["hit_rate"] = 0.405
    assert direction_check(real, sim)[0]["agree"]  # level on both
    runs = [run("round-robin", 0, 0.44, 90, 160, 0.5, 0.0), run("picker", 0, 0.83, 40, 100, 0.55, 1.0)]
    summary = medians(runs, ("round-robin", "picker"))
    section: dict[str, Any] = {"spec": {**RealSpec().__dict__, "requests": 240},
                               "calibration": {"tokens_per_word": 2.5},
                               "runs": [*runs, {"strategy": "picker", "repeat": 1, "error": "boom"}],
                               "medians": summary, "targets": targets(summary), "sim": {}, "sim_direction": []}
    text = report(section)
    assert "| picker | 0.83 |" in text and "boom" in text and "23.3 ms" in text  # 1/12 x 60 + 11/12 x 20
    assert "not meaningful" not in text
    mirrored = {"hit_rate": 0.8, "ttft_mean_ms": 50.0, "ttft_p50_ms": 30.0, "ttft_p90_ms": 90.0, "max_share": 0.5,
                "metrics_requests_per_pod_per_s": 1.0}
    assert "not meaningful" not in report({**section, "sim": {"picker": mirrored}})
    assert mirror_overshoots(summary, {"picker": {**mirrored, "ttft_mean_ms": 130.0}}) == ["picker"]  # > 3 x 40
    assert "not meaningful here**: the simulated mean TTFT of picker" in report(
        {**section, "sim": {"picker": {**mirrored, "ttft_mean_ms": 130.0}}})


def test_scrapes_are_read_per_pod_from_the_pickers_own_counter() -> None:
    metrics = PickerMetrics("pool")
    a, b = Endpoint.from_address("10.0.0.1:8000"), Endpoint.from_address("10.0.0.2:8000")
    for ok in (True, True, False):
        metrics.pool.observe_scrape(a, ok)
    metrics.pool.observe_scrape(b, True)
    assert scrapes_per_pod(generate_latest(metrics.registry).decode()) == {"10.0.0.1:8000": 3.0, "10.0.0.2:8000": 1.0}


def test_cold_requests_are_told_apart_by_cause_in_send_order() -> None:
    records = [
        answered(0.0, 1, "a", 0),    # first of group 1
        answered(1.0, 1, "a", 90),   # warm
        answered(2.0, 1, "b", 0),    # copy: group 1 moved to b
        answered(3.0, 2, "b", 10),   # first of group 2 (a little cached is still cold)
        answered(4.0, 1, "a", 20),   # a held group 1 and dropped it: evicted
        answered(5.0, 2, "b", 60),   # warm (over half)
        answered(7.0, 3, "a", 0),    # first of group 3
    ]
    records.reverse()  # completion order is not send order
    rows = request_rows(records, ["a", "b"])
    assert len(DETAIL_COLUMNS) == len(rows[0]) and [r[0] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0]
    assert rows[2] == [2.0, 1, 1, 100, 0, 50.0]
    assert cold_kinds(rows) == ["first", "warm", "copy", "first", "evicted", "warm", "first"]
    assert cold_causes(rows) == {"first": 3, "copy": 1, "evicted": 1}
    assert request_rows(records, ["a"])[2][2] == -1 and request_rows([], ["a"]) == []  # b unknown


def test_report_shows_groups_per_pod_and_cold_causes() -> None:
    runs = [run("picker", 0, 0.83, 40, 100, 0.55, 1.0)]
    summary = medians(runs, ("picker",))
    section: dict[str, Any] = {"spec": {**RealSpec().__dict__, "requests": 240},
                               "calibration": {"tokens_per_word": 2.5}, "runs": runs, "medians": summary,
                               "targets": targets(summary), "sim": {}, "sim_direction": []}
    assert "| 3/2 | 5 / 1 / 2 |" in report(section)


def test_report_says_when_the_pool_changed_and_leave_targets_are_on_p90() -> None:
    runs = [run("picker", i, 0.83, 40, 100, 0.55, 1.0) | {"pool_changes": [["left", 60.0 + i], ["stopped", 64.0],
                                                                           ["joined", 121.0]]} for i in range(3)]
    runs += [run("hash-ring", i, 0.80, 46, 130, 0.6, 0.2) for i in range(3)]
    spec = RealSpec.for_workload("leave-rejoin")
    summary = medians(runs, ("picker", "hash-ring"))
    section: dict[str, Any] = {"spec": {**asdict(spec), "requests": spec.requests},
                               "calibration": {"tokens_per_word": 2.5}, "runs": runs, "medians": summary,
                               "targets": targets(summary, "leave-rejoin"), "sim": {}, "sim_direction": []}
    text = report(section)
    assert "left 61 s, stopped 64 s, joined 121 s" in text
    assert "the last server leaves (out of the endpoints, drained, stopped) at 30% of the trace" in text
    assert [t["target"] for t in section["targets"]] == ["picker TTFT p90 <= 0.85x the better hash baseline's"]
    assert section["targets"][0]["met"]  # 100 <= 0.85 x 130


def test_ttft_breakdown_separates_warm_requests_queued_behind_a_cold_prefill() -> None:
    rows = [  # sent_s, group, pod, prompt_tokens, cached_tokens, ttft_ms
        [0.0, 1, 0, 100, 0, 400.0],    # cold on pod 0 until 0.4 s
        [0.1, 2, 0, 100, 90, 300.0],   # warm, pod 0, during that cold prefill
        [0.2, 3, 1, 100, 90, 50.0],    # warm, pod 1: nothing cold there
        [0.5, 2, 0, 100, 90, 50.0],    # warm, pod 0, after the cold one answered
    ]
    got = ttft_breakdown(rows)
    assert {k: (v["n"], v["mean_ms"]) for k, v in got.items()} == {
        "cold": (1, 400.0), "warm_behind_cold": (1, 300.0), "warm_clear": (2, 50.0)}
    assert got["cold"]["share"] == 0.5 and got["warm_clear"]["share"] == 0.125
    runs = [run("picker", i, 0.8, 40, 100, 0.5, 1.0) | {"requests_detail": rows} for i in range(2)]
    text = "\n".join(where_ttft_goes([*runs, run("round-robin", 0, 0.4, 90, 160, 0.5, 0.0)], ["picker", "round-robin"]))
    assert "| picker | 3/2, 3/2 | 5 / 1 / 2 | 1, 400, 50% | 1, 300, 38% | 2, 50, 12% | 40.0 | 200.0 |" in text
    assert "round-robin" not in text  # no per-request rows recorded for it
    assert where_ttft_goes([run("picker", 0, 0.8, 40, 100, 0.5, 1.0)], ["picker"]) == []


def test_first_placements_measure_the_prefill_work_ahead_of_each_groups_first_request() -> None:
    rows = [  # sent_s, group, pod, prompt_tokens, cached_tokens, ttft_ms
        [0.0, 1, 0, 600, 0, 500.0],    # group 1's first: nothing ahead anywhere; prefills on pod 0 until 0.5 s
        [0.1, 2, 0, 600, 0, 900.0],    # group 2's first: 600 ahead on pod 0, 0 on pod 1 (the heavier pod chosen)
        [0.2, 1, 0, 600, 576, 700.0],  # group 1 again (24 uncached): reaches pod 0 while both firsts prefill there
        [0.3, 3, 1, 600, 0, 400.0],    # group 3's first: pod 1 is the lighter (0 against 600 + 600 + 24)
    ]
    assert first_placements(rows, 2) == [(0.0, 0.0, 2.0, 500.0), (600.0, 0.0, 1.0, 900.0), (0.0, 1224.0, 0.0, 400.0)]
    # a server that answered nothing is still a place the router could have chosen
    assert first_placements(rows[:3], 3)[1] == (600.0, 0.0, 1.0, 900.0)
    runs = [run("picker", i, 0.8, 40, 100, 0.5, 1.0) | {"requests_detail": rows} for i in range(2)]
    moved = run("hash-ring", 0, 0.8, 40, 100, 0.5, 0.2) | {"requests_detail": rows, "pool_changes": [["left", 1.0]]}
    text = "\n".join(first_placement_lines([*runs, moved], ["picker", "hash-ring"]))
    assert "| picker | 6 | 200 / 408 | 2 / 2 | 1.00 | 600 | 4, 450 |" in text
    assert "hash-ring" not in text  # its pool changed: a pod out of the pool would count as the lightest
    assert first_placement_lines([run("picker", 0, 0.8, 40, 100, 0.5, 1.0)], ["picker"]) == []


def test_warm_requests_are_split_by_whether_the_other_pod_was_prefilling_cold() -> None:
    rows = [  # sent_s, group, pod, prompt_tokens, cached_tokens, ttft_ms
        [0.0, 1, 0, 600, 0, 1000.0],   # cold on pod 0: prefills from 0 to 1 s
        [0.2, 1, 0, 600, 576, 900.0],  # warm, but behind that cold prefill on its own pod: in neither class
        [0.5, 2, 1, 600, 576, 300.0],  # warm on pod 1 while pod 0 prefills cold: other_cold
        [0.9, 2, 1, 600, 576, 50.0],   # waits 0.9-0.95 s, pod 0 still cold until 1 s: other_cold
        [2.0, 2, 1, 600, 576, 100.0],  # nothing cold anywhere: clear
        [2.5, 1, 0, 600, 576, 120.0],  # clear on pod 0 too
    ]
    assert cross_pod_warm(rows) == {"clear": [100.0, 120.0], "other_cold": [300.0, 50.0]}
    runs = [run("picker", i, 0.8, 40, 100, 0.5, 1.0) | {"requests_detail": rows} for i in range(2)]
    text = "\n".join(cross_pod_lines(runs, ["picker", "hash-ring"]))
    assert "## Do the servers slow each other?" in text and "| picker | 4, 110 | 4, 175 | 1.59x |" in text
    assert "| hash-ring |" not in text  # no per-request rows: no line
    assert cross_pod_lines([run("picker", 0, 0.8, 40, 100, 0.5, 1.0)], ["picker"]) == []


def test_the_mirror_at_other_rates_judges_each_rate_by_the_runs_targets() -> None:
    """One seeded trace per rate of a small conversation workload: each rate gets the run's own target row, and the
    simulated figures move with the offered load (a table that ignored the rate would repeat itself)."""
    spec = replace(RealSpec.for_workload("multi-turn", strategies=("hash-ring", "picker")), groups=8)
    section = {"spec": {**asdict(spec), "requests": spec.requests}, "sim_slowdown": 2.0, "medians": {}}
    lines = mirror_at_rates(section, [1.0, 8.0], seeds=1)
    assert lines[0] == "## The simulator's mirror at other rates (machine speed x2.00, means over 1 traces)"
    rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 8 |")]
    assert len(rows) == 2 and all("picker TTFT p90 <= 0.85x the better hash baseline's" in row for row in rows)
    assert rows[0].split("|")[3] != rows[1].split("|")[3]


def test_mean_without_avoidable_colds_keeps_first_visits_and_prices_the_rest_as_warm() -> None:
    rows = [  # sent_s, group, pod, prompt_tokens, cached_tokens, ttft_ms
        [0.0, 1, 0, 100, 0, 400.0],   # group 1's first: unavoidable
        [1.0, 1, 1, 100, 0, 500.0],   # group 1 again, cold (a copy): avoidable, priced at the warm mean
        [2.0, 1, 1, 100, 90, 60.0],
        [3.0, 1, 0, 100, 90, 100.0],
    ]
    assert mean_without_avoidable_colds(rows) == (400.0 + 80.0 + 60.0 + 100.0) / 4
    assert math.isnan(mean_without_avoidable_colds([])) and math.isnan(mean_without_avoidable_colds(rows[:2]))


def test_the_mirror_runs_at_the_measured_machine_speed_and_the_spec_round_trips() -> None:
    summary = {"a": {"ttft_cold_p50_ms": 380.0}, "b": {"ttft_cold_p50_ms": 570.0},
               "c": {"ttft_cold_p50_ms": math.nan}}  # a router with no cold request does not count
    assert machine_slowdown(summary) == 2.5
    assert machine_slowdown({"c": {"ttft_cold_p50_ms": math.nan}}) == 1.0
    spec = RealSpec(strategies=("picker", "round-robin"), repeats=2, picker_args=("--log-level", "INFO"))
    recorded = json.loads(json.dumps(asdict(spec) | {"requests": spec.requests}))
    assert RealSpec.recorded(recorded) == spec


def test_conversations_are_chains_of_turns_sent_after_each_answer() -> None:
    spec = RealSpec.for_workload("multi-turn", groups=3, turns=4, system_tokens=40, question_tokens=8, think_s=0.01,
                                 rate=50.0)
    trace = build_trace(spec, tokens_per_word=2.0)
    assert len(trace) == spec.requests == 12
    conversations = chains(trace)
    assert [[r.turn for r in c] for c in conversations] == [[0, 1, 2, 3]] * 3
    assert [c[0].group for c in conversations] == [0, 1, 2] and all(r.group == c[0].group for c in conversations
                                                                    for r in c)
    assert all(a[0].at < b[0].at for a, b in zip(conversations, conversations[1:], strict=False))
    assert len(conversations[0][0].prompt.split()) > 20 > len(conversations[0][1].prompt.split())
    assert chains(build_trace(RealSpec(groups=2, prompts_per_group=3), 2.0)) == [[r] for r in build_trace(
        RealSpec(groups=2, prompts_per_group=3), 2.0)]  # shared prefixes: every request on its own


async def test_replay_sends_each_turn_with_the_conversation_so_far() -> None:
    """Against an echo pod (its usage counts the body it got): every later turn carries the earlier ones, and is
    sent only once the previous answer is complete."""
    spec = RealSpec.for_workload("multi-turn", groups=2, turns=3, system_tokens=40, question_tokens=8, think_s=0.01,
                                 rate=50.0)
    with process_scope("replay-turns") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        records = await replay(f"http://{backends.addresses[0]}", build_trace(spec, 2.0), spec)
    assert len(records) == 6 and all(r["status"] == 200 for r in records)
    for group in (0, 1):
        mine = [r for r in records if r["group"] == group]
        sizes = [r["usage"]["prompt_tokens"] for r in mine]
        assert sizes[0] < sizes[1] < sizes[2]
        assert all(a["done"] <= b["sent"] for a, b in zip(mine, mine[1:], strict=False))


def test_runs_of_one_workload_combine_and_a_disturbed_repeat_is_left_out_in_view() -> None:
    def section(means: list[float], spec: RealSpec) -> dict[str, Any]:
        runs = [run(s, i, 0.8, mean + k, 100, 0.5, 0.2) for i, mean in enumerate(means)
                for k, s in enumerate(("round-robin", "picker"))]
        return {"spec": asdict(spec) | {"requests": spec.requests}, "calibration": {"tokens_per_word": 2.0},
                "runs": runs, "logdir": "x"}

    hot = RealSpec.for_workload("hot", strategies=("round-robin", "picker"))
    merged = combine([section([900, 50, 60], hot), section([70], replace(hot, repeats=1))], drop=(1,),
                     why="a simulator shared the cores")
    assert sorted({r["repeat"] for r in merged["runs"]}) == [1, 2, 3]  # repeat 4 is the second run's first
    assert merged["spec"]["repeats"] == 3 and merged["medians"]["round-robin"]["ttft_mean_ms"] == 60
    assert [r["ttft_mean_ms"] for r in merged["dropped"]["runs"]] == [900, 901]
    text = report({**merged, "sim": {}, "sim_direction": []})
    assert "## Repeats left out" in text and "a simulator shared the cores" in text and "| picker | 901.0 |" in text
    with pytest.raises(ValueError, match="different workloads"):
        combine([section([1], hot), section([1], RealSpec())])


def test_a_scheduling_file_is_refused_with_the_real_engines_not_ignored(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--scheduling` configures the in-process scheduler of the fast and live modes; the real benchmark runs
    `picker serve`, which would silently run its defaults: say so before anything is installed or started."""
    from picker_lab.bench.cli import main as bench_main

    config = tmp_path / "scheduling.yaml"
    config.write_text("plugins: []\n")
    assert bench_main(["--engine", "vllm", "--workload", "hot", "--scheduling", str(config),
                       "--out", str(tmp_path / "out")]) == 2
    assert "--picker-args '--config-file FILE'" in capsys.readouterr().err


def test_the_model_shape_is_checked_and_only_taken_with_the_real_engines(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """An unknown shape is refused before anything is installed; in the other modes the flag would be silently
    ignored, so it is refused there too."""
    from picker_lab.bench.cli import main as bench_main
    from picker_lab.bench.vllm_engine import MODEL_SHAPES

    assert bench_main(["--engine", "vllm", "--workload", "hot", "--model-shape", "huge",
                       "--out", str(tmp_path / "out")]) == 2
    assert "unknown model shape 'huge' (known: small, medium)" in capsys.readouterr().err
    assert bench_main(["--mode", "fast", "--model-shape", "medium", "--out", str(tmp_path / "fast")]) == 2
    assert "--model-shape: only with --engine vllm" in capsys.readouterr().err
    assert RealSpec.for_workload("hot", model="medium").model == "medium"
    assert RealSpec.recorded({"model": "medium", "workload": "hot"}).model == "medium"
    assert {"small", "medium"} <= set(MODEL_SHAPES)


def test_requests_scale_a_real_workload_by_prompts_per_prefix_and_are_refused_for_conversations(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A fast machine needs a higher rate to be loaded, and more requests to keep the same span (a leave and a join
    tens of seconds apart): --requests scales the prompts per prefix; conversations have no such knob."""
    from picker_lab.bench.cli import main as bench_main

    spec = RealSpec.for_workload("leave-rejoin").with_requests(700)
    assert (spec.groups, spec.prompts_per_group, spec.requests) == (12, 58, 696)
    assert spec.leave_at == 0.3 and spec.strategies == ("hash-ring", "bounded-load", "picker")
    with pytest.raises(ValueError, match="at least one per group"):
        RealSpec.for_workload("uniform").with_requests(5)
    assert bench_main(["--engine", "vllm", "--workload", "multi-turn", "--requests", "400",
                       "--out", str(tmp_path / "out")]) == 2
    assert "30 conversations of 6 turns; scale it with --rate" in capsys.readouterr().err


def test_reused_servers_are_refused_where_a_pod_leaves_and_only_taken_with_the_real_engines(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A pod leaving stops its server, so that workload needs fresh servers; in the simulator's modes the flag
    would be ignored, so it is refused there too. The report says which kind of servers the runs had."""
    from picker_lab.bench.cli import main as bench_main

    assert bench_main(["--engine", "vllm", "--workload", "leave-rejoin", "--reuse-servers",
                       "--out", str(tmp_path / "out")]) == 2
    assert "need fresh servers (drop --reuse-servers)" in capsys.readouterr().err
    assert bench_main(["--mode", "fast", "--reuse-servers", "--out", str(tmp_path / "fast")]) == 2
    assert "--reuse-servers: only with --engine vllm" in capsys.readouterr().err
    spec = RealSpec.for_workload("hot", reuse_servers=True)
    assert RealSpec.recorded(asdict(spec)).reuse_servers
    recorded_before = {k: v for k, v in asdict(spec).items() if k != "seed_per_repeat"}
    assert not RealSpec.recorded(recorded_before).seed_per_repeat  # runs recorded before it: one trace
    runs = [run("hash-ring", 0, 0.8, 100.0, 200.0, 0.5, 0.2), run("picker", 0, 0.8, 90.0, 180.0, 0.5, 1.0)]
    runs[1]["router_cpu_share"] = 0.042
    section: dict[str, Any] = {"spec": asdict(spec) | {"requests": spec.requests},
                               "calibration": {"tokens_per_word": 2.4}, "runs": runs,
                               "medians": medians(runs, ("hash-ring", "picker")), "targets": []}
    text = report(section)
    assert "The same servers for every run, their prefix caches emptied between runs" in text
    section["settling_ttft_ms"] = [251.6, 140.2, 133.9]
    assert "after 3 unmeasured passes of the trace through round-robin (TTFT mean 252, 140, 134 ms)" in report(section)
    ring, picker = (next(line for line in text.splitlines() if line.startswith(f"| {name} | "))
                    for name in ("hash-ring", "picker"))  # the first table's rows: the medians
    assert ring.endswith("| - | 0 |")  # a run from before the router's CPU was measured
    assert picker.endswith("| 0.042 | 0 |")
    section["spec"]["reuse_servers"] = False
    assert "Fresh servers for every run; every repeat the same trace" in report(section)
    section["spec"].update(reuse_servers=True, seed_per_repeat=True, seed=5, repeats=3)
    assert "each repeat its own trace (seeds 5-7)" in report(section)


def test_a_reset_prefix_cache_is_retried_until_vllm_accepts_it() -> None:
    """vLLM refuses a reset while blocks are held (`{"success": false}`): the call retries, and gives up loudly."""
    import http.server
    import threading
    from pathlib import Path
    from typing import cast

    from picker_lab.bench.vllm_engine import VllmServer

    answers = [False, False, True]
    calls: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the library's name)
            calls.append(self.path)
            body = json.dumps({"success": answers.pop(0) if answers else False}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server = VllmServer(httpd.server_address[1], cast(Any, None), Path("unused.log"))
        server.reset_prefix_cache()
        assert calls == ["/reset_prefix_cache"] * 3
        with pytest.raises(TimeoutError, match="refused to reset its prefix cache"):
            server.reset_prefix_cache(limit_s=0.0)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_each_routers_measured_path_delays_its_requests_and_slows_its_engines_in_the_mirror() -> None:
    """The real run's hold and router CPU become the simulated router's path: requests reach their pod that much
    later, engines run slower by the CPU taken beyond the lightest router's; runs without them get none."""
    summary: dict[str, dict[str, Any]] = {"round-robin": {"request_held_ms": [0.3, 0.4], "router_cpu_share": 0.02},
               "picker": {"request_held_ms": [2.5, 5.0], "router_cpu_share": 0.06},
               "hash-ring": {"router_cpu_share": 0.05}}  # recorded before Envoy timed requests: no path
    paths = router_paths(summary, servers=2)
    assert paths["round-robin"] == RouterPath(0.0003, 1.0)
    assert paths["picker"].delay == 0.0025 and paths["picker"].engine_slowdown == pytest.approx(1 / 0.98)
    assert "hash-ring" not in paths and router_paths({"picker": {"router_cpu_share": math.nan}}, 2) == {}
    spec = replace(RealSpec.for_workload("hot", strategies=("round-robin", "picker-round-robin")), prompts_per_group=15)
    free = sim_mirror(spec, seeds=1)
    costly = sim_mirror(spec, seeds=1, paths={"picker-round-robin": RouterPath(0.05, 1.5)})
    assert free["picker-round-robin"]["ttft_mean_ms"] == pytest.approx(free["round-robin"]["ttft_mean_ms"], rel=0.02)
    assert costly["picker-round-robin"]["ttft_mean_ms"] > 1.5 * costly["round-robin"]["ttft_mean_ms"]
    assert costly["round-robin"] == free["round-robin"]  # a router without a measured path is simulated as before


def test_the_mirror_runs_the_peer_routers_as_their_text_tree_policy() -> None:
    spec = replace(RealSpec.for_workload("uniform", strategies=("round-robin", "sglang-router")), prompts_per_group=4)
    sim = sim_mirror(spec, seeds=1)
    assert set(sim) == {"round-robin", "sglang-router", "picker (fixed 50 ms scrape)"}
    assert sim["sglang-router"]["hit_rate"] > sim["round-robin"]["hit_rate"] + 0.1  # each prefix on one pod


def test_a_peer_router_is_measured_without_the_per_pod_sections_it_cannot_have() -> None:
    """A peer router (no Envoy of ours: no timing, no pod per request) keeps its TTFT rows and its CPU in the report
    and is left out of what needs the pod."""
    rows = [[0.0, 1, 0, 600, 0, 500.0], [0.1, 1, 0, 600, 576, 300.0], [0.2, 2, 1, 600, 0, 400.0]]
    ours = run("picker", 0, 0.8, 40, 100, 0.5, 1.0) | {"requests_detail": rows, "router_cpu_share": 0.05,
                                                      "request_held_ms": [2.0, 4.0], "response_held_ms": [0.1, 0.2]}
    peer = run("sglang-router", 0, 0.8, 40, 100, 0.5, 0.0) | {
        "requests_detail": [[sent, group, -1, prompt, cached, ttft] for sent, group, _, prompt, cached, ttft in rows],
        "pods_known": False, "router_cpu_share": 0.03}
    runs = [ours, peer]
    assert "sglang-router" in busier_pick_lines([ours | {"strategy": "sglang-router"}], ["sglang-router"])[-1]
    text = "\n".join(busier_pick_lines(runs, ["picker", "sglang-router"]))
    assert "| picker |" in text and "sglang-router" not in text
    costs = "\n".join(routing_cost_lines(runs, medians(runs, ("picker", "sglang-router"))))
    assert "| picker | 2.00 / 4.00 |" in costs and "| sglang-router | (no Envoy) | (no Envoy) | 0.030 |" in costs


def test_paired_ratios_fall_back_to_the_hash_ring_when_round_robin_did_not_run() -> None:
    runs = [run("hash-ring", i, 0.8, mean, 2 * mean, 0.5, 0.2) for i, mean in enumerate((200, 100))]
    runs += [run("sglang-router", i, 0.8, mean, 2 * mean, 0.5, 0.0) for i, mean in enumerate((150, 120))]
    lines = paired_ratio_lines(runs, ["hash-ring", "sglang-router"])
    assert "## Against hash-ring, repeat by repeat" in lines
    assert "| sglang-router | 2 | 0.97x (0.75-1.20) | 0.97x (0.75-1.20) |" in lines


def test_a_pool_change_is_reported_phase_by_phase_for_every_router() -> None:
    from picker_lab.bench.real_analysis import phase_figures, phase_lines

    detail = [[5.0, 0, -1, 800, 0, 100.0], [15.0, 0, -1, 800, 700, 200.0], [25.0, 1, -1, 800, 0, 300.0],
              [30.0, 1, -1, 800, 700, 500.0]]
    peer = run("sglang-router", 0, 0.8, 275, 500, 0.5, 0.0) | {
        "pool_changes": [["left", 10.0], ["stopped", 12.0], ["joined", 20.0]], "requests_detail": detail,
        "share": [0.5, 0.25, 0.25], "completed": 4, "pods_known": False}
    figures = phase_figures(peer)
    assert figures is not None
    assert figures.means_ms == (100.0, 200.0, 400.0)
    assert figures.joined_share == 0.5  # the joined server served 1 of the 2 sent after
    assert figures.slowest == (0, 0, 1)  # the p90 (440 ms) falls after the join: only the 500 ms request is above it
    assert phase_figures(run("picker", 0, 0.8, 275, 500, 0.5, 1.0)) is None  # no pool change
    assert "| sglang-router | 1 | 100.0 | 200.0 | 400.0 | 0.50 | 0 / 0 / 1 |" in phase_lines([peer], ["sglang-router",
                                                                                                 "picker"])
