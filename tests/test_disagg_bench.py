"""P/D in the benchmark's fast mode: a disaggregated request runs as the sidecar runs it (a one-token prefill leg
on a prefill pod, then the decode pod loads the prompt's blocks), and the scenario reports P/D against
aggregated serving."""

from __future__ import annotations

from pathlib import Path

from picker.scheduling.config import DEFAULT_CONFIG
from picker_lab.bench.disagg import PdSpec, PdWorkload, pd_scheduling, run_pd
from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.summary import summarize
from picker_lab.sim.profiles import get_profile

PROFILE = get_profile("llama3-8b-h100")
LONG = PdWorkload("long", 1.0)


def _rate(load: float, pods: int) -> float:
    return load * pods / LONG.mean_cost(PROFILE)


def test_a_disaggregated_request_is_prefilled_on_a_prefill_pod_and_decoded_from_the_transferred_blocks() -> None:
    trace = LONG.trace(200, _rate(0.5, 4), 3)
    cfg = FastConfig(PROFILE, 4, seed=3, roles=("prefill", "prefill", "decode", "decode"))
    run = run_fast(trace, "picker", cfg, scheduling=pd_scheduling(1024))
    row = summarize(run)
    assert row["completed"] == 200
    assert run.pod_served[:2] == [0, 0] and sum(run.pod_served[2:]) == 200  # the client hears the decode pods
    assert all(t > 0 for t in run.ttft)
    prefill_legs = run.generation_tokens - sum(run.output_tokens)  # each leg generates the one token it asks
    assert 150 <= prefill_legs <= 200


def test_prefill_decode_interference_is_what_disaggregation_removes() -> None:
    """Long prompts at half the capacity: aggregated pods run prefill chunks in the steps of their decodes, so
    inter-token latency suffers; with two of four pods prefilling, decode steps carry (almost) no prefill (0.71-0.74x
    over seeds 1-3). Never disaggregating leaves half the pods idle: far worse."""
    trace = LONG.trace(300, _rate(0.5, 4), 1)
    aggregated = summarize(run_fast(trace, "picker", FastConfig(PROFILE, 4, seed=1), scheduling=DEFAULT_CONFIG))
    split = summarize(run_fast(trace, "picker", FastConfig(PROFILE, 4, seed=1, roles=("prefill",) * 2 + ("decode",) * 2),
                               scheduling=pd_scheduling(1024)))
    assert split["itl_p95"] < 0.8 * aggregated["itl_p95"]
    never = summarize(run_fast(trace, "picker", FastConfig(PROFILE, 4, seed=1, roles=("prefill",) * 2 + ("decode",) * 2),
                               scheduling=pd_scheduling(0)))  # 0: never disaggregate, prefill pods idle
    assert never["itl_p95"] > split["itl_p95"]


def test_the_scenario_writes_its_tables(tmp_path: Path) -> None:
    spec = PdSpec(requests=60, loads=(0.5,), splits=(2,), thresholds=(1024,), seeds=(1,), queue_limits=(None,),
                  queue_splits=(2,))
    section = run_pd(spec, tmp_path)
    assert [(r["workload"], r["fleet"]) for r in section["rows"]] == [
        ("long", "aggregated 4"), ("long", "P/D 2P+2D"), ("mixed", "aggregated 4"), ("mixed", "P/D 2P+2D")]
    assert all(r["completed"] == 60 for r in section["rows"])
    text = (tmp_path / "pd.md").read_text()
    assert "| long | 0.5 | P/D 2P+2D |" in text and "| 1024 |" in text and "| P/D 2P+2D | none |" in text
