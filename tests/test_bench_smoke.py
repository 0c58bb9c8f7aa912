"""A reduced `picker bench --smoke` (fast mode): the report is complete and prefix-aware routing shows up in it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from picker_lab.bench import cli
from picker_lab.bench.report import check_complete
from picker_lab.bench.summary import FIGURES

STRATEGIES = ["round-robin", "random", "least-load", "prefix-only", "picker"]


def test_reduced_smoke_report_is_complete_and_picker_beats_round_robin(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    started = time.monotonic()
    rc = cli.main(["--smoke", "--mode", "fast", "--workloads", "shared-prefix,hot-prefix", "--requests", "300",
                   "--sweep-requests", "150", "--sweep-loads", "0.6,1.0", "--capacity-requests", "150",
                   "--pods", "3", "--jobs", "2", "--out", str(out)])
    elapsed = time.monotonic() - started
    assert rc == 0
    assert elapsed < 90

    report = json.loads((out / "report.json").read_text())
    assert check_complete(report, STRATEGIES) == []
    fast = report["fast"]
    assert set(fast["workloads"]) == {"shared-prefix", "hot-prefix"}
    for data in fast["workloads"].values():
        assert list(data["strategies"]) == STRATEGIES
        for row in data["strategies"].values():
            assert set(FIGURES) <= set(row)
            assert row["completed"] == 300
            assert row["ratio_to_round_robin"]["ttft_mean"] is not None
    assert report["seed"] == 1 and report["versions"]["python"]
    assert {r["strategy"] for r in fast["sweep"]} == set(STRATEGIES)
    assert set(fast["capacity"]["strategies"]) == set(STRATEGIES)
    assert fast["targets"], "targets are evaluated"

    plots = report["plots"]
    assert {"ttft_cdf_shared-prefix.png", "sweep_shared-prefix.png", "pod_load_hot-prefix.png"} <= set(plots)
    for name in plots:
        assert (out / name).stat().st_size > 5_000
    md = (out / "report.md").read_text()
    assert "| **picker** |" in md and "### shared-prefix" in md

    sp = fast["workloads"]["shared-prefix"]["strategies"]
    assert sp["picker"]["hit_rate"] > sp["round-robin"]["hit_rate"] + 0.1
    assert sp["picker"]["hit_rate"] <= sp["picker"]["oracle_hit_rate"] + 1e-9


async def test_the_sim_serves_every_endpoint_the_peer_routers_call() -> None:
    import asyncio

    from picker_lab.bench.peers import check_worker
    from picker_lab.sim.fleet import SimFleet

    async with SimFleet(1, profile="tiny-cpu") as fleet:
        result = await asyncio.to_thread(check_worker, fleet.urls[0])
    assert result == {"/health": "ok", "/get_server_info": "ok", "/get_model_info": "ok",
                      "/v1/completions/render": "ok", "/tokenize": "ok"}
    assert "failed" in check_worker("http://127.0.0.1:9", timeout=0.5)["/health"]


async def test_a_peer_refuses_to_start_when_a_worker_lacks_what_it_routes_with(tmp_path: Path) -> None:
    """vLLM answers vllm-router's render endpoint with 403 unless told otherwise: a run must say so, not measure
    a peer that forwards without routing by prefix."""
    import asyncio

    from picker_lab.bench.peers import PEERS, missing_endpoints, start_replicas
    from picker_lab.sim.fleet import SimFleet

    async with SimFleet(1, profile="tiny-cpu") as fleet:
        assert await asyncio.to_thread(missing_endpoints, PEERS["vllm-router"], fleet.urls) == []
    with pytest.raises(RuntimeError, match="vllm-router cannot route by prefix.*/v1/completions/render"):
        start_replicas(PEERS["vllm-router"], ["http://127.0.0.1:9"], tmp_path)
    assert missing_endpoints(PEERS["sglang-router"], ["http://127.0.0.1:9"]) == []
