"""`picker sim --engine`: each engine's metric page, parsed back by the picker, shows the simulated engine's queue,
running count, KV use, cache geometry and model; TensorRT-LLM's gauges move only when a request finishes."""

from __future__ import annotations

import json

import pytest

from picker.endpoints.metrics import parse_metrics
from picker_lab.sim.dialects import DIALECTS, PROMETHEUS_TEXT, MetricDialect
from picker_lab.sim.engine import Engine, SimRequest, StepResult
from picker_lab.sim.metrics import SimMetrics
from picker_lab.sim.profiles import TINY_CPU

PROFILE = TINY_CPU.with_overrides(max_num_seqs=2)  # two run at once: the rest of a burst waits
PROMPT = list(range(100, 400))


def loaded(dialect: MetricDialect) -> tuple[Engine, SimMetrics, float]:
    """A short request and four long ones: stepped until the short one finished (three wait, one runs)."""
    engine = Engine(PROFILE)
    metrics = SimMetrics(engine, "sim-model", process_metrics=False, dialect=dialect)
    engine.add_request(SimRequest("short", PROMPT, 2), 0.0)
    for i in range(4):
        engine.add_request(SimRequest(f"long-{i}", PROMPT, 40), 0.0)
    now = 0.0
    while True:
        result = step(engine, metrics, now)
        now = result.end
        if any(f.request_id == "short" for f in result.finished):
            return engine, metrics, now


def step(engine: Engine, metrics: SimMetrics, now: float) -> StepResult:
    result = engine.step(max(now, engine.next_step_time() or 0.0))
    metrics.observe_step(result)
    return result


def scraped(metrics: SimMetrics, path: str) -> str:
    """The body of one of the pod's metrics pages."""
    pages = {page.path: page for page in metrics.pages()}
    return pages[path].render().decode()


PROMETHEUS_PATH = {"vllm": "/metrics", "sglang": "/metrics", "trtllm": "/prometheus/metrics"}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_each_engines_page_parses_back_to_the_engine_state(dialect: MetricDialect) -> None:
    engine, metrics, _ = loaded(dialect)
    m = parse_metrics(scraped(metrics, PROMETHEUS_PATH[dialect]))
    assert (engine.num_waiting, engine.num_running) == (3, 1) and engine.kv_usage() > 0
    assert (m.waiting, m.running) == (3.0, 1.0)
    assert m.kv_usage == pytest.approx(engine.kv_usage(), abs=1e-12)
    assert m.models == frozenset({"sim-model"}) and m.block_size == PROFILE.block_size
    # vLLM reports its null block among num_gpu_blocks; the others report the blocks requests can use
    assert m.num_gpu_blocks == (PROFILE.num_gpu_blocks if dialect == "vllm" else PROFILE.usable_blocks())


def test_pages_are_served_where_each_engine_serves_them() -> None:
    routes = {d: [(p.path, p.content_type) for p in SimMetrics(Engine(PROFILE), "m", process_metrics=False,
                                                                dialect=d).pages()] for d in DIALECTS}
    assert routes == {"vllm": [("/metrics", PROMETHEUS_TEXT)], "sglang": [("/metrics", PROMETHEUS_TEXT)],
                      "trtllm": [("/prometheus/metrics", PROMETHEUS_TEXT), ("/metrics", "application/json")]}
    assert b"sglang:" not in SimMetrics(Engine(PROFILE), "m", process_metrics=False).render()


def test_trtllm_gauges_hold_the_last_finished_requests_view_and_json_drains() -> None:
    engine = Engine(PROFILE)
    metrics = SimMetrics(engine, "sim-model", process_metrics=False, dialect="trtllm")
    engine.add_request(SimRequest("a", PROMPT, 40), 0.0)
    step(engine, metrics, 0.0)
    before = parse_metrics(scraped(metrics, "/prometheus/metrics"))
    assert engine.num_running == 1 and (before.running, before.models) == (0.0, frozenset({"sim-model"}))

    engine, metrics, now = loaded("trtllm")
    iterations = json.loads(scraped(metrics, "/metrics"))
    assert [it["iter"] for it in iterations] == list(range(len(iterations))) and len(iterations) > 1
    assert parse_metrics(json.dumps(iterations)).waiting == 3.0
    while engine.num_waiting == 3:  # the next steps admit a waiting request; none finishes
        assert not step(engine, metrics, now).finished
    gauges = parse_metrics(scraped(metrics, "/prometheus/metrics"))
    newest = parse_metrics(scraped(metrics, "/metrics"))
    assert (gauges.waiting, gauges.running) == (3.0, 1.0)  # stale until a request finishes, as trtllm-serve's
    assert (newest.waiting, newest.running) == (2.0, 2.0) == (engine.num_waiting, engine.num_running)
    assert newest.kv_usage == pytest.approx(engine.kv_usage()) and newest.num_gpu_blocks == PROFILE.usable_blocks()
    assert scraped(metrics, "/metrics") == "[]"  # read once: the queue is empty until the next iteration
