"""Fast-mode suite: calibrate each workload, then run every (workload, strategy) cell, the load sweep and the
capacity search in worker processes, all from the same seeded traces.

A cell names its trace (workload, size, rate, seed, fleet) instead of carrying it: each worker regenerates it
deterministically, which is cheaper than pickling 100k prompts.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from picker.endpoints.scraper import Cadence
from picker_lab.bench.capacity import cost_per_request, rate_for_load, smallest_fleet
from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.progress import ProgressBar
from picker_lab.bench.results import RunResult
from picker_lab.bench.summary import summarize, ttft_sample
from picker_lab.bench.trace import Trace
from picker_lab.bench.workloads import FleetSpec, generate
from picker_lab.sim.profiles import Profile, get_profile


@dataclass(frozen=True)
class FastSpec:
    """Everything a fast-mode run depends on (also written to the report)."""

    profile: str = "llama3-8b-h100"
    profile_overrides: tuple[tuple[str, Any], ...] = ()
    pods: int = 8
    workloads: tuple[str, ...] = ("chat", "code", "multi-turn", "summarize", "shared-prefix", "bursty", "hot-prefix")
    strategies: tuple[str, ...] = ("round-robin", "random", "least-load", "prefix-only", "picker")
    load: float = 0.8
    rate: float | None = None  # absolute requests/s; overrides load
    requests: int = 4000
    seed: int = 1
    arrival: str = "poisson"
    scheduling: str = ""  # picker scheduling config as JSON (a string keeps the spec hashable)
    sweep_loads: tuple[float, ...] = (0.5, 0.7, 0.85, 1.0, 1.15)
    sweep_workloads: tuple[str, ...] = ("shared-prefix", "multi-turn")
    sweep_requests: int = 2000
    capacity_workload: str | None = "shared-prefix"
    capacity_requests: int = 1500
    ttft_target: float | None = None  # seconds; None = 3 x the workload's cache-blind request cost
    jobs: int = 0  # 0 = os.cpu_count()
    workload_params: str = ""  # JSON {workload: {param: value}}
    # How the picker's scrapes are modelled: a fixed 50 ms cadence of free scrapes (the figures in the README), or
    # picker serve's adaptive cadence, each scrape holding the pod's API server `scrape_cost` seconds.
    adaptive_scrape: bool = False
    scrape_cost: float = 0.0

    def get_profile(self) -> Profile:
        return get_profile(self.profile).with_overrides(**dict(self.profile_overrides))

    def params(self, workload: str) -> dict[str, Any]:
        return dict(json.loads(self.workload_params).get(workload, {})) if self.workload_params else {}

    def scheduling_config(self) -> dict[str, Any] | None:
        return json.loads(self.scheduling) if self.scheduling else None


@dataclass(frozen=True)
class Cell:
    """One replay: trace identity + the fleet it runs on + the strategy."""

    kind: str  # "main" | "sweep" | "capacity"
    workload: str
    strategy: str
    n: int
    rate: float
    load: float
    run_pods: int
    keep_series: bool = False


@dataclass
class SuiteResult:
    """Everything the report needs from fast mode."""

    spec: FastSpec
    calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    main: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # workload -> strategy -> figures
    cdf: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # workload -> strategy -> TTFT quantiles
    series: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # workload -> strategy -> load
    sweep: list[dict[str, Any]] = field(default_factory=list)
    capacity: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0


_progress_queue: Any = None


def _init_worker(q: Any) -> None:
    global _progress_queue
    _progress_queue = q


def _report_progress(n: int) -> None:
    if _progress_queue is not None:
        _progress_queue.put(n)


@functools.lru_cache(maxsize=8)
def _trace(spec: FastSpec, workload: str, n: int, rate: float) -> Trace:
    params = {"arrival": spec.arrival, **spec.params(workload)}
    return generate(workload, n, rate, spec.seed, FleetSpec(spec.get_profile(), spec.pods), **params)


def _fast_config(spec: FastSpec, pods: int) -> FastConfig:
    return FastConfig(spec.get_profile(), pods, seed=spec.seed, cadence=Cadence() if spec.adaptive_scrape else None,
                      scrape_cost=spec.scrape_cost)


def _quantiles(res: RunResult) -> list[float]:
    values = ttft_sample(res, 100_000)
    if not values:
        return []
    return [values[min(len(values) - 1, int(q / 100 * len(values)))] for q in range(0, 101)]


def _thin_series(res: RunResult, points: int = 150) -> dict[str, Any]:
    step = max(1, math.ceil(len(res.load_times) / points))
    return {"t": [round(t, 3) for t in res.load_times[::step]], "per_pod": res.load_per_pod[::step]}


def replay(spec: FastSpec, cell: Cell) -> RunResult:
    """One cell's trace replayed in fast mode, every request's columns kept (for analyses beyond the figures)."""
    trace = _trace(spec, cell.workload, cell.n, cell.rate)
    return run_fast(trace, cell.strategy, _fast_config(spec, cell.run_pods), scheduling=spec.scheduling_config(),
                    progress=_report_progress)


def run_cell(spec: FastSpec, cell: Cell) -> dict[str, Any]:
    """Run one cell in this process; returns its figures (and CDF/series extras)."""
    res = replay(spec, cell)
    out: dict[str, Any] = {"figures": summarize(res), "wall_s": res.wall_s, "notes": res.notes}
    if cell.kind == "main":
        out["cdf"] = _quantiles(res)
    if cell.keep_series:
        out["series"] = _thin_series(res)
    return out


def run_capacity(spec: FastSpec, workload: str, strategy: str, rate: float, target: float, n: int) -> dict[str, Any]:
    """Smallest fleet (bisection over pods) whose p95 TTFT holds `target` at `rate`, for one strategy."""
    trace = _trace(spec, workload, n, rate)
    tried: dict[int, float] = {}

    def p95(pods: int) -> float:
        if pods not in tried:
            res = run_fast(trace, strategy, _fast_config(spec, pods), scheduling=spec.scheduling_config())
            tried[pods] = summarize(res)["ttft_p95"]
            _report_progress(n)
        return tried[pods]

    best = smallest_fleet(p95, target, 1, 2 * spec.pods)
    return {"strategy": strategy, "smallest_fleet": best, "p95_by_pods": {str(k): v for k, v in sorted(tried.items())}}


def _pool(jobs: int, q: Any) -> ProcessPoolExecutor:
    ctx = multiprocessing.get_context("fork")
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=(q,))


def _drain(q: Any, bar: ProgressBar, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            bar.advance(q.get(timeout=0.2))
        except queue.Empty:
            continue
        except (EOFError, OSError):
            return


def calibrate(spec: FastSpec) -> dict[str, dict[str, float]]:
    """Per workload: cache-blind cost per request, capacity and the rate the run uses."""
    fleet = FleetSpec(spec.get_profile(), spec.pods)
    out: dict[str, dict[str, float]] = {}
    for w in dict.fromkeys((*spec.workloads, *spec.sweep_workloads, *(filter(None, [spec.capacity_workload])))):
        cost = cost_per_request(w, fleet, spec.seed, spec.params(w))
        capacity = rate_for_load(1.0, spec.pods, cost)
        rate = spec.rate if spec.rate is not None else rate_for_load(spec.load, spec.pods, cost)
        out[w] = {"cost_s_per_request": cost, "capacity_rps": capacity, "rate_rps": rate, "load": rate / capacity}
    return out


def run_suite(spec: FastSpec, *, log: Callable[[str], None] = lambda s: None) -> SuiteResult:
    """Calibrate, then run main cells, sweep cells and the capacity search; progress on stderr."""
    import time

    t0 = time.monotonic()
    result = SuiteResult(spec)
    result.calibration = calibrate(spec)
    cal = result.calibration
    series_workload = "hot-prefix" if "hot-prefix" in spec.workloads else spec.workloads[0]
    cells: list[Cell] = [
        Cell("main", w, s, spec.requests, cal[w]["rate_rps"], cal[w]["load"], spec.pods, keep_series=w == series_workload)
        for w in spec.workloads for s in spec.strategies
    ]
    for w in spec.sweep_workloads:
        for load in spec.sweep_loads:
            rate = rate_for_load(load, spec.pods, cal[w]["cost_s_per_request"])
            cells += [Cell("sweep", w, s, spec.sweep_requests, rate, load, spec.pods) for s in spec.strategies]
    cap_w = spec.capacity_workload
    target = spec.ttft_target
    if cap_w:
        if target is None:
            profile = spec.get_profile()
            target = 3 * _mean_request_cost(spec, cap_w, profile)
        result.capacity = {"workload": cap_w, "rate_rps": cal[cap_w]["rate_rps"], "ttft_p95_target_s": target,
                           "requests": spec.capacity_requests, "strategies": {}}
    # each capacity search runs ~log2(2 x pods) + 1 replays
    cap_work = int(spec.capacity_requests * (math.log2(2 * spec.pods) + 2)) * len(spec.strategies) if cap_w else 0
    bar = ProgressBar(sum(c.n for c in cells) + cap_work, "fast mode")
    jobs = spec.jobs or os.cpu_count() or 1
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    stop = threading.Event()
    drainer = threading.Thread(target=_drain, args=(q, bar, stop), daemon=True)
    drainer.start()
    try:
        with _pool(jobs, q) as pool:
            futures: dict[Future[dict[str, Any]], tuple[str, Any]] = {}
            for cell in cells:
                futures[pool.submit(run_cell, spec, cell)] = ("cell", cell)
            if cap_w and target is not None:
                for s in spec.strategies:
                    fut = pool.submit(run_capacity, spec, cap_w, s, cal[cap_w]["rate_rps"], target,
                                      spec.capacity_requests)
                    futures[fut] = ("capacity", s)
            for fut in as_completed(futures):
                what, key = futures[fut]
                out = fut.result()
                if what == "capacity":
                    result.capacity["strategies"][key] = out
                    continue
                _store(result, key, out)
    finally:
        stop.set()
        drainer.join(timeout=2)
        bar.close()
    result.wall_s = time.monotonic() - t0
    log(f"fast mode done in {result.wall_s:.0f}s")
    return result


def _mean_request_cost(spec: FastSpec, workload: str, profile: Profile) -> float:
    """Cache-blind cost of a mean request plus one step overhead: what TTFT is on an idle pod with no hit."""
    cost = cost_per_request(workload, FleetSpec(profile, spec.pods), spec.seed, spec.params(workload))
    return cost + profile.step_overhead_s


def _store(result: SuiteResult, cell: Cell, out: dict[str, Any]) -> None:
    figures = {**out["figures"], "wall_s": out["wall_s"]}  # how long the replay took (fast-mode speed)
    result.notes.extend(f"{cell.workload}/{cell.strategy}: {n}" for n in out.get("notes", ()))
    if cell.kind == "main":
        result.main.setdefault(cell.workload, {})[cell.strategy] = figures
        result.cdf.setdefault(cell.workload, {})[cell.strategy] = out.get("cdf", [])
        if "series" in out:
            result.series.setdefault(cell.workload, {})[cell.strategy] = out["series"]
    else:
        result.sweep.append({"workload": cell.workload, "strategy": cell.strategy, "load": cell.load,
                             "rate_rps": cell.rate, **{k: figures[k] for k in (
                                 "hit_rate", "ttft_mean", "ttft_p95", "e2e_p95", "completed", "oracle_hit_rate")}})


def ordered(strategies: Iterable[str], rows: dict[str, Any]) -> list[str]:
    """Strategies in the order asked for, keeping only those with rows."""
    return [s for s in strategies if s in rows]
