"""The benchmark's fast mode and `picker serve` run literally the same director steps: what fast mode's director
was given (arrivals, scraped metrics, ended requests, in simulated time) replayed through `Director.route`, the
path `picker serve` takes (its requests held on asyncio futures), gives the same decisions in the same order."""

from __future__ import annotations

import copy
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

from picker.core.requests import RequestError
from picker.routing.decision import Decision
from picker_lab.bench.fast import DirectorInput, _FastRun, make_scheduler
from picker_lab.bench.overload import (
    FLOW_CONFIG,
    MIX,
    admission_section,
    fast_capacity,
    fast_config,
    fast_trace,
)

SEQS = 4  # sequences per pod: the pods fill and flow control holds requests


class SimulatedClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def replay(run: _FastRun, inputs: list[DirectorInput]) -> list[tuple[str, int, str]]:
    """The inputs through `route()`: each request's coroutine is stepped by hand, so a held one resumes exactly
    where fast mode placed it (its future must be resolved by then, or it raises)."""
    clock = SimulatedClock()
    endpoints = run.make_endpoints()
    director = run.make_director(endpoints, make_scheduler("picker", run.cfg.seed), clock)
    held: dict[int, Coroutine[Any, Any, Decision]] = {}
    decisions: dict[int, Decision] = {}
    outcomes: list[tuple[str, int, str]] = []

    def step(i: int, coroutine: Coroutine[Any, Any, Decision], kind: str) -> None:
        try:
            coroutine.send(None)
        except StopIteration as done:
            decisions[i] = done.value
            outcomes.append(("placed", i, done.value.destination))
        except RequestError as err:
            outcomes.append((kind, i, str(err.status)))
        else:
            held[i] = coroutine  # waits on its hold's future

    for entry in inputs:
        clock.now = entry.at
        if entry.kind == "arrive":
            assert entry.request is not None
            step(entry.index, director.route(copy.copy(entry.request)), "refused")
        elif entry.kind == "placed" and entry.index in held:
            step(entry.index, held.pop(entry.index), "placed")
        elif entry.kind == "scraped":
            assert entry.metrics is not None
            endpoint = endpoints[entry.pod]
            endpoint.metrics = copy.copy(entry.metrics)
            endpoint.scrape_interval = entry.interval
            director.gate.pod_refreshed(endpoint)  # what the scraper's listener tells the gate in picker serve
        elif entry.kind == "ended":
            director.release(decisions[entry.index])
        elif entry.kind in ("joined", "left"):
            director.pool.set_endpoints(endpoints if entry.kind == "joined" else endpoints[:entry.pod])
        assert entry.kind != "expired", "a queue TTL passed: this replay has no timers"
    for coroutine in held.values():
        coroutine.close()
    assert not held, f"requests fast mode placed never left their hold: {sorted(held)}"
    return outcomes


def decided(inputs: list[DirectorInput]) -> list[tuple[str, int, str]]:
    return [(e.kind, e.index, e.outcome) for e in inputs if e.kind in ("placed", "refused")]


async def test_flow_control_under_overload_decides_the_same_through_picker_serves_path() -> None:
    cap = fast_capacity(2, seed=3, requests=120, max_num_seqs=SEQS)
    trace = fast_trace(2.0 * cap, 6.0, MIX, seed=3)
    admission = admission_section(FLOW_CONFIG.replace("{enabled: true}", "{enabled: true, queueTtl: 600s}"))
    cfg = fast_config(2, admission, seed=3, max_num_seqs=SEQS)
    run = _FastRun(trace, "picker", replace(cfg, record_inputs=True), None, None)
    run.run()
    assert run.inputs is not None
    expected = decided(run.inputs)
    arrived_at = {e.index: e.at for e in run.inputs if e.kind == "arrive"}
    held = [e for e in run.inputs if e.kind == "placed" and e.at > arrived_at[e.index]]
    assert len(held) > 20 and any(kind == "refused" for kind, _, _ in expected)  # holds and refusals both ran
    assert await replay(run, run.inputs) == expected
