"""The simulator's view of a real-engine run: the same workload through fast mode at the run's measured machine
speed, scrape cost and routers' own delays (`mirror`), and whether it orders the routers as the real run did."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from picker.endpoints.scraper import Cadence
from picker_lab.bench.configs import PREDICTED_TTFT_CONFIG
from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.peers import PEERS
from picker_lab.bench.real import STRATEGIES, RealSpec, targets
from picker_lab.bench.real_analysis import HASH_BASELINES
from picker_lab.bench.summary import percentile, summarize
from picker_lab.bench.workloads import FleetSpec, multi_turn, shared_prefix
from picker_lab.sim.profiles import TINY_CPU

# The small model alone on one core, measured: an 800-token cold prefill ~160 ms, a cached request's TTFT ~35 ms,
# ~5 ms per decode step (under the benchmark's load ~190 and ~47 ms). The mirror's engine model is the tiny-cpu profile with those two rates.
SMALL_PREFILL_TOKEN_S = 170e-6
SMALL_STEP_S = 0.005
# The median TTFT of a mostly cold request in the benchmark on the machine those rates were measured on. Shared
# machines run the same model up to ~2.3x slower from day to day; the mirror scales its rates by this run's
# measured cold TTFT over this one (`machine_slowdown`), since how much a cold copy costs decides routing.
SMALL_COLD_TTFT_MS = 190.0


def machine_slowdown(summary: dict[str, dict[str, Any]]) -> float:
    """How much slower than SMALL_COLD_TTFT_MS this run's cold requests were (median over routers of their cold
    TTFT medians); 1.0 when no router had a cold request."""
    cold = [r["ttft_cold_p50_ms"] for r in summary.values() if not math.isnan(r["ttft_cold_p50_ms"])]
    return statistics.median(cold) / SMALL_COLD_TTFT_MS if cold else 1.0


@dataclass(frozen=True)
class RouterPath:
    """What a router's own path cost each request in a real run: Envoy held it `delay` seconds before the pod got it,
    and the router's processes took `engine_slowdown` of the engines' time from cores they share (1.0: none)."""

    delay: float
    engine_slowdown: float = 1.0


def router_paths(summary: dict[str, dict[str, Any]], servers: int) -> dict[str, RouterPath]:
    """Each router's path cost as its run measured it: the median time Envoy held a request, and the CPU its
    processes took beyond the lightest timed router's (Envoy alone, when round-robin ran), spread over the servers'
    cores. Routers Envoy did not time (the peers) get none; empty for runs recorded before Envoy timed requests and
    the routers' CPU was read."""
    timed = {s: r for s, r in summary.items()
             if r.get("request_held_ms") and not math.isnan(r.get("router_cpu_share", math.nan))}
    if not timed:
        return {}
    lightest = min(r["router_cpu_share"] for r in timed.values())
    return {s: RouterPath(r["request_held_ms"][0] / 1000,
                          1.0 / (1.0 - min(0.5, (r["router_cpu_share"] - lightest) / servers)))
            for s, r in timed.items()}


def sim_mirror(spec: RealSpec, seeds: int = 3, slowdown: float = 1.0,
               paths: dict[str, RouterPath] | None = None) -> dict[str, dict[str, Any]]:
    """The same workload shape and routers in fast mode (picker sim's engine model with the small model's rates
    times `slowdown`, scrapes costing the pod's API server SCRAPE_COST_S each, and with `paths` each router's
    measured path: its requests reach the pod that much later, its engines run that much slower): does the
    simulator rank the routers as the real servers do? Means over `seeds` traces, as the real repeats sample
    several placements (prefix-hash's depends on the pods' addresses). The peer routers run as `text-tree` (their
    policy; no path of theirs is timed). Also the picker with the old fixed 50 ms scrape, which only the simulator
    can add (on the picker's path)."""
    profile = TINY_CPU.with_overrides(block_size=spec.block_size, num_gpu_blocks=spec.num_blocks,
                                      prefill_token_s=SMALL_PREFILL_TOKEN_S * slowdown,
                                      step_overhead_s=SMALL_STEP_S * slowdown)
    fleet = FleetSpec(profile, spec.servers)
    health_only = Cadence.fixed(5.0)
    scrape_cost = spec.scrape_cost_s

    def setups(seed: int, span: float) -> dict[str, tuple[str, FastConfig]]:
        moves = (spec.leave_at * span, spec.rejoin_at * span) if spec.leave_at else None

        def fleet_cfg(router: str, **kw: Any) -> FastConfig:
            path = (paths or {}).get(router)
            return FastConfig(profile.slower(path.engine_slowdown) if path else profile, spec.servers, seed=seed,
                              leave_rejoin=moves, path_delay=path.delay if path else 0.0, **kw)

        return {
            "round-robin": ("round-robin", fleet_cfg("round-robin", admission=False, scraping=False)),
            **{name: (name, fleet_cfg(name, cadence=health_only, scrape_cost=scrape_cost))
               for name in HASH_BASELINES},
            # the peers' cache_aware policy, which reads no metrics (text-tree-scorer)
            **{name: ("text-tree", fleet_cfg(name, admission=False, scraping=False)) for name in PEERS},
            "picker": ("picker", fleet_cfg("picker", cadence=Cadence(), scrape_cost=scrape_cost)),
            "picker-predicted-ttft": ("picker", fleet_cfg("picker-predicted-ttft", cadence=Cadence(),
                                                          scrape_cost=scrape_cost)),
            "picker-round-robin": ("round-robin", fleet_cfg("picker-round-robin", cadence=Cadence(),
                                                            scrape_cost=scrape_cost)),
            "picker-4-replicas": ("picker", fleet_cfg("picker-4-replicas", replicas=4, shared_index=True,
                                                      cadence=Cadence(compare_in_flight=False),
                                                      scrape_cost=scrape_cost)),
            "picker (fixed 50 ms scrape)": ("picker", fleet_cfg("picker", cadence=Cadence.fixed(0.05),
                                                                scrape_cost=scrape_cost)),
        }

    rows: dict[str, list[dict[str, float]]] = {}
    for seed in range(spec.seed, spec.seed + seeds):
        trace = (multi_turn(spec.requests, spec.rate, seed, fleet, turns=spec.turns, system_prompts=1, system_len=1,
                            first_len=spec.system_tokens + spec.question_tokens, question_len=spec.question_tokens,
                            think_mean=spec.think_s, output_len=spec.output_tokens) if spec.turns else
                 shared_prefix(spec.requests, spec.rate, seed, fleet, system_prompt_len=spec.system_tokens,
                               question_len=spec.question_tokens, output_len=spec.output_tokens,
                               num_prompts_per_group=spec.prompts_per_group, num_groups=spec.groups,
                               group_weights=spec.group_weights))
        for name, (strategy, cfg) in setups(seed, trace.requests[-1].at).items():
            if name in STRATEGIES and name not in spec.strategies:
                continue
            res = run_fast(trace, strategy, cfg,
                           scheduling=PREDICTED_TTFT_CONFIG if name == "picker-predicted-ttft" else None)
            figures = summarize(res)
            served = res.pod_served
            ttft = np.array([t for t in res.ttft if not math.isnan(t)]) * 1000
            rows.setdefault(name, []).append({
                "hit_rate": figures["vllm_hit_rate"], "ttft_mean_ms": figures["ttft_mean"] * 1000,
                "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
                "max_share": max(served) / sum(served) if sum(served) else math.nan,
                "metrics_requests_per_pod_per_s": res.extra.get("scrapes_per_pod_per_s", 0.0)})
    return {name: {k: statistics.mean(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}


# Differences smaller than these are "level": within the run-to-run noise of the real benchmark (TTFT means of one
# router move by ~10-20 % between repeats; hit rates by < 0.01).
_LEVEL = {"hit_rate": ("abs", 0.01), "ttft_mean_ms": ("rel", 0.05), "ttft_p90_ms": ("rel", 0.05)}


def _order(a: float, b: float, figure: str) -> int:
    """+1 / -1 when a is above / below b by more than the noise margin, 0 when they are level."""
    kind, margin = _LEVEL[figure]
    limit = margin if kind == "abs" else margin * max(abs(a), abs(b))
    return 0 if abs(a - b) <= limit else (1 if a > b else -1)


def direction_check(real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each pair of routers and each figure: does the simulator order them as the real servers do (higher,
    lower or level within the noise margin)?"""
    rows = []
    names = [s for s in real if s in sim]
    for figure in _LEVEL:
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                r = _order(real[a][figure], real[b][figure], figure)
                m = _order(sim[a][figure], sim[b][figure], figure)
                rows.append({"figure": figure, "a": a, "b": b, "real": real[a][figure] - real[b][figure],
                             "sim": sim[a][figure] - sim[b][figure], "agree": r == m})
    return rows


# A simulated router whose mean TTFT is this many times its real one ran a saturated mirror: the machine's slowdown,
# estimated from the cold requests' TTFT, overshot because they queued (pressure run3: 35x, every mean 13-15x)
MIRROR_OVERSHOOT = 3.0


def mirror_overshoots(real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]]) -> list[str]:
    """The routers whose simulated mean TTFT is over MIRROR_OVERSHOOT times their real one."""
    return [s for s in real if s in sim and sim[s]["ttft_mean_ms"] > MIRROR_OVERSHOOT * real[s]["ttft_mean_ms"]]


def mirror(section: dict[str, Any], spec: RealSpec, seeds: int = 3) -> None:
    """Add the simulator's mirror of a run (at the run's measured machine speed, means over `seeds` traces) and its
    direction check."""
    slowdown = machine_slowdown(section["medians"])
    paths = router_paths(section["medians"], spec.servers)
    section["sim_slowdown"] = slowdown
    section["sim_seeds"] = seeds
    section["sim_paths"] = {s: {"delay_ms": p.delay * 1000, "engine_slowdown": p.engine_slowdown}
                            for s, p in paths.items()}
    section["sim"] = sim_mirror(spec, seeds=seeds, slowdown=slowdown, paths=paths)
    section["sim_direction"] = direction_check(section["medians"], section["sim"])


def mirror_at_rates(section: dict[str, Any], rates: list[float], seeds: int = 3) -> list[str]:
    """The simulator's mirror of a run replayed at other offered rates, at the run's machine speed, judged by the
    run's own targets: does the simulator expect the routers' order to move with the load (a question to put to the
    real servers next, not an answer)? Printed, not stored with the run."""
    spec = RealSpec.recorded(section["spec"])
    slowdown = section.get("sim_slowdown") or machine_slowdown(section["medians"])
    paths = router_paths(section["medians"], spec.servers)
    lines = [f"## The simulator's mirror at other rates (machine speed x{slowdown:.2f}, means over {seeds} traces)", "",
             "| rate (req/s) | target | simulated | met |", "|---:|---|---|---|"]
    for rate in rates:
        for t in targets(sim_mirror(replace(spec, rate=rate), seeds=seeds, slowdown=slowdown, paths=paths),
                         spec.workload):
            lines.append(f"| {rate:g} | {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
    return lines
