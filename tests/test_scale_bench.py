"""`picker bench --scenario scale` measures what it says on a small run: decision times per pool size, round trips
through Envoy and ext_proc per pool size, the scrape parse cost of a real vLLM page, the index's memory, the shared
load's syncs on a real Valkey."""

from __future__ import annotations

from pathlib import Path

from picker_lab.bench.scale import ScaleSpec, run_scale, sizing


def test_the_scale_scenario_reports_each_pool_size(tmp_path: Path) -> None:
    section = run_scale(ScaleSpec(pools=(8, 32), decisions=60, index_prefixes=5_000, routing=((8, 40, ("chat",)),),
                                  replicas=(2, 3), syncs=5, round_trip_pools=(2, 6), round_trips=20, idle_window_s=0.3),
                        tmp_path)
    rows = section["decisions"]
    assert [(r["pods"], r["sampled"]) for r in rows] == [(8, False), (8, True), (32, False), (32, True)]
    assert all(0 < r["p50_us"] <= r["p99_us"] and r["decisions_per_s"] > 0 for r in rows)
    assert section["scrape"]["page_bytes"] > 50_000 and section["scrape"]["parse_us"] > 0
    assert section["index"]["entries"] == 40_000 and section["index"]["bytes_per_entry"] > 0
    assert "| 32 | defaults (sampled) |" in (tmp_path / "scale.md").read_text()
    trips = section["round_trips"]  # through real Envoy and picker serve, to echo pods
    assert [(r["pods"], r["requests"]) for r in trips] == [(2, 20), (6, 20)]
    assert all(0 < r["p50_us"] <= r["p99_us"] and 0 <= r["idle_cores"] < 2 for r in trips)
    assert "| 6 | " in (tmp_path / "scale.md").read_text().split("Through Envoy")[1]
    loads = {(r["pods"], r["replicas"]): r for r in section["shared_load"]}
    assert set(loads) == {(8, 2), (8, 3), (32, 2), (32, 3)}
    assert all(0 < r["sync_p50_us"] <= r["sync_p99_us"] for r in loads.values())
    # a report grows with the pool; a sync reads every replica's
    assert loads[(32, 2)]["report_bytes"] > loads[(8, 2)]["report_bytes"] > 0
    assert loads[(32, 3)]["received_bytes"] > loads[(32, 2)]["received_bytes"]
    # 8 pods: under the sample's threshold, so both routings are the same
    every, sampled = section["routing"]
    assert (every["sampled"], sampled["sampled"]) == (False, True)
    assert every["ttft_mean"] == sampled["ttft_mean"] and every["hit_rate"] == sampled["hit_rate"]


def test_the_sizing_rows_follow_from_the_measured_costs() -> None:
    spec = ScaleSpec(pools=(64, 1000), rates=(1_000, 10_000), request_cpu_us=1000.0, valkey_cpu_us=20.0)
    section = {"decisions": [{"pods": 64, "sampled": True, "mean_us": 200.0},
                             {"pods": 1000, "sampled": True, "mean_us": 400.0},
                             {"pods": 1000, "sampled": False, "mean_us": 2000.0}],
               "shared_load": [{"pods": 1000, "replicas": 4, "received_bytes": 40_000.0, "sync_p50_us": 1000.0},
                               {"pods": 1000, "replicas": 16, "received_bytes": 160_000.0, "sync_p50_us": 5000.0}]}
    low, high = sizing(section, spec)
    assert low["cpu_per_request_us"] == high["cpu_per_request_us"] == 1200.0  # 1,000 + (400 - 200)
    assert (low["replicas"], high["replicas"]) == (2, 18)  # 1,000 x 1.2 ms / 0.7 -> 1.7; 10,000 -> 17.1
    assert high["measured_replicas"] == 16
    assert high["valkey_index_cores"] == 10_000 * 20e-6 * 18  # every replica reads every pick
    # 16 replicas' sync took 5 ms: every 100 ms (5 %), not 50
    assert abs(high["load_syncs_per_s"] - 18 / 0.1) < 1e-9
    assert abs(high["load_read_mb_s"] - 18 * (160_000 * 18 / 16) / 0.1 / 1e6) < 1e-9
