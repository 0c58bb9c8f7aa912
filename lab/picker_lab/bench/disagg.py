"""`picker bench --scenario pd`: prefill/decode disaggregation against aggregated serving at equal pod count.

Fast mode (the discrete-event simulator): the same pods serve either as one aggregated pool routed by the picker's
defaults, or split into prefill and decode pods routed by a P/D config (`disagg-profile-handler` with
`prefix-based-pd-decider`); a disaggregated request runs as `picker pd-sidecar` runs it (the prompt with one
output token on the prefill pod, then the decode pod loads the prompt's blocks at the profile's
`kv_transfer_cost` and decodes). What P/D buys in the simulator is what it buys on GPUs: a prefill chunk shares
its engine step with every running decode on an aggregated pod (their next tokens wait for it), and never on a
decode pod. Workloads: `long` (unique long prompts, long outputs) and `mixed` (a share of long prompts among
short ones), each at three loads; then where `nonCachedTokens` should sit on `mixed`.
"""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from picker.scheduling.config import DEFAULT_CONFIG
from picker_lab.bench.capacity import request_cost
from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.summary import summarize
from picker_lab.bench.trace import Trace, TraceRequest
from picker_lab.bench.workloads import arrivals, text
from picker_lab.sim.profiles import Profile, get_profile


@dataclass(frozen=True, slots=True)
class PdWorkload:
    """Unique prompts (no prefix shared: disaggregation, not caching, is measured), `long_share` of them long."""

    name: str
    long_share: float
    long_tokens: int = 2048
    short_tokens: int = 512
    output_tokens: int = 256

    def trace(self, n: int, rate: float, seed: int) -> Trace:
        rng = random.Random(f"pd-{self.name}:{seed}")
        times = arrivals(rng, rate, n)
        reqs = []
        for i, t in enumerate(times):
            tokens = self.long_tokens if rng.random() < self.long_share else self.short_tokens
            reqs.append(TraceRequest(i, t, self.output_tokens, prompt=(text(rng, tokens),)))
        return Trace(f"pd-{self.name}", seed, rate, tuple(reqs), {"long_share": self.long_share})

    def mean_cost(self, profile: Profile) -> float:
        """Cache-blind accelerator seconds per request (the load scale)."""
        long = request_cost(profile, self.long_tokens, self.output_tokens)
        short = request_cost(profile, self.short_tokens, self.output_tokens)
        return self.long_share * long + (1 - self.long_share) * short


WORKLOADS = (PdWorkload("long", 1.0), PdWorkload("mixed", 0.3))


def pd_scheduling(non_cached_tokens: int, **handler: Any) -> dict[str, Any]:
    """The P/D config the scenario routes with: the reference's P/D sample with our load scorers; `handler`: more
    parameters of the disagg-profile-handler (e.g. maxPrefillQueueTokens)."""
    load = [{"pluginRef": "queue-scorer", "weight": 1}, {"pluginRef": "in-flight-load-scorer", "weight": 1}]
    return {
        "plugins": [
            {"type": "prefix-cache-scorer"}, {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
            {"type": "in-flight-load-scorer"}, {"type": "prefill-filter"}, {"type": "decode-filter"},
            {"type": "max-score-picker"},
            {"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"},
                                                              **handler}},
            {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": non_cached_tokens}},
        ],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"},
                                            {"pluginRef": "prefix-cache-scorer", "weight": 2}, *load]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"},
                                           {"pluginRef": "prefix-cache-scorer", "weight": 2}, *load,
                                           {"pluginRef": "kv-cache-utilization-scorer", "weight": 1}]},
        ],
    }


@dataclass(frozen=True, slots=True)
class PdSpec:
    profile: str = "llama3-8b-h100"
    pods: int = 4
    requests: int = 1500
    loads: tuple[float, ...] = (0.5, 0.8, 1.0)
    splits: tuple[int, ...] = (1, 2, 3)  # prefill pods of the disaggregated fleets
    thresholds: tuple[int, ...] = (256, 1024, 4096)  # nonCachedTokens tried on `mixed` at the middle load
    sweep_split: int = 2  # ... on a fleet with this many prefill pods
    # maxPrefillQueueTokens tried on `long` at the middle load (the default, 8192, is in the main table; None: no
    # backlog check, the reference's rule), for these splits
    queue_limits: tuple[int | None, ...] = (None, 2048, 32768)
    queue_splits: tuple[int, ...] = (1, 2)
    threshold: int = 1024  # nonCachedTokens of the comparison runs
    seeds: tuple[int, ...] = (1, 2)
    workloads: tuple[PdWorkload, ...] = field(default=WORKLOADS)


FIGURES = ("ttft_mean", "ttft_p90", "itl_p95", "output_tokens_per_s", "e2e_p95")


_DEFAULT_LIMIT = object()  # the handler's own maxPrefillQueueTokens


def _run(spec: PdSpec, workload: PdWorkload, load: float, seed: int, prefill_pods: int,
         threshold: int, queue_limit: Any = _DEFAULT_LIMIT) -> dict[str, Any]:
    profile = get_profile(spec.profile)
    rate = load * spec.pods / workload.mean_cost(profile)
    trace = workload.trace(spec.requests, rate, seed)
    if prefill_pods:
        roles = ("prefill",) * prefill_pods + ("decode",) * (spec.pods - prefill_pods)
        cfg = FastConfig(profile, spec.pods, seed=seed, roles=roles)
        handler = {} if queue_limit is _DEFAULT_LIMIT else {"maxPrefillQueueTokens": queue_limit}
        res = run_fast(trace, "picker", cfg, scheduling=pd_scheduling(threshold, **handler))
    else:
        res = run_fast(trace, "picker", FastConfig(profile, spec.pods, seed=seed),
                       scheduling=copy.deepcopy(DEFAULT_CONFIG))
    row = summarize(res)
    return {k: row[k] for k in (*FIGURES, "completed", "requests")}


def _median(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in FIGURES:
        values = [r[key] for r in rows if not math.isnan(r[key])]
        out[key] = statistics.median(values) if values else math.nan
        out[f"{key}_range"] = [min(values), max(values)] if values else [math.nan, math.nan]
    out["completed"] = sum(r["completed"] for r in rows)
    out["requests"] = sum(r["requests"] for r in rows)
    return out


def fleet_name(prefill_pods: int, pods: int) -> str:
    return f"aggregated {pods}" if not prefill_pods else f"P/D {prefill_pods}P+{pods - prefill_pods}D"


def run_pd(spec: PdSpec, out: Path) -> dict[str, Any]:
    """Every (workload, load, fleet) over the seeds, then the threshold and backlog sweeps; writes pd.json and
    pd.md."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for workload in spec.workloads:
        for load in spec.loads:
            for split in (0, *spec.splits):
                runs = [_run(spec, workload, load, seed, split, spec.threshold) for seed in spec.seeds]
                rows.append({"workload": workload.name, "load": load, "fleet": fleet_name(split, spec.pods),
                             "non_cached_tokens": spec.threshold if split else None, **_median(runs)})
    middle = spec.loads[len(spec.loads) // 2]
    mixed = next(w for w in spec.workloads if w.name == "mixed")
    sweep = []
    for threshold in spec.thresholds:
        runs = [_run(spec, mixed, middle, seed, spec.sweep_split, threshold) for seed in spec.seeds]
        sweep.append({"workload": "mixed", "load": middle, "fleet": fleet_name(spec.sweep_split, spec.pods),
                      "non_cached_tokens": threshold, **_median(runs)})
    long = next(w for w in spec.workloads if w.name == "long")
    backlog = []
    for split in spec.queue_splits:
        for limit in spec.queue_limits:
            runs = [_run(spec, long, middle, seed, split, spec.threshold, limit) for seed in spec.seeds]
            backlog.append({"workload": "long", "load": middle, "fleet": fleet_name(split, spec.pods),
                            "max_prefill_queue_tokens": limit, **_median(runs)})
    section = {"spec": {"profile": spec.profile, "pods": spec.pods, "requests": spec.requests,
                        "loads": list(spec.loads), "seeds": list(spec.seeds), "threshold": spec.threshold,
                        "workloads": [w.name for w in spec.workloads]},
               "rows": rows, "sweep": sweep, "backlog": backlog}
    (out / "pd.json").write_text(json.dumps(section, indent=1))
    (out / "pd.md").write_text(render(section))
    return section


def _fmt(row: dict[str, Any], key: str, scale: float, digits: int) -> str:
    lo, hi = row[f"{key}_range"]
    return f"{row[key] * scale:.{digits}f} ({lo * scale:.{digits}f}-{hi * scale:.{digits}f})"


def render(section: dict[str, Any]) -> str:
    spec = section["spec"]
    lines = [f"# P/D against aggregated serving ({spec['pods']} pods, {spec['profile']}, {spec['requests']} requests "
             f"per run, median (range) of seeds {spec['seeds']})", "",
             f"Disaggregated fleets route with nonCachedTokens {spec['threshold']}. Load: share of the aggregated "
             "fleet's cache-blind capacity.", "",
             "| workload | load | fleet | TTFT mean ms | TTFT p90 ms | ITL p95 ms | output tokens/s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['load']} | {r['fleet']} | {_figures(r)} |" for r in section["rows"]]
    lines += ["", "Where the threshold sits (`mixed` at the middle load, 2 prefill pods):", "",
              "| nonCachedTokens | TTFT mean ms | TTFT p90 ms | ITL p95 ms | output tokens/s |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['non_cached_tokens']} | {_figures(r)} |" for r in section["sweep"]]
    lines += ["", "The backlog check (`long` at the middle load; maxPrefillQueueTokens 8192, the default, is in the "
              "first table; none: every request over the threshold goes to the prefill pod, the reference's rule):", "",
              "| fleet | maxPrefillQueueTokens | TTFT mean ms | TTFT p90 ms | ITL p95 ms | output tokens/s |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['fleet']} | {r['max_prefill_queue_tokens'] or 'none'} | {_figures(r)} |"
              for r in section.get("backlog", [])]
    return "\n".join(lines) + "\n"


def _figures(r: dict[str, Any]) -> str:
    return (f"{_fmt(r, 'ttft_mean', 1e3, 0)} | {_fmt(r, 'ttft_p90', 1e3, 0)} | {_fmt(r, 'itl_p95', 1e3, 1)} | "
            f"{_fmt(r, 'output_tokens_per_s', 1, 0)}")
