"""What the repeats of a real-engine run add up to: runs of one workload combined, each router's medians, and the
targets the run is judged by."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, replace
from typing import Any

from picker_lab.bench.real_analysis import HASH_BASELINES, held_medians
from picker_lab.bench.real_spec import RealSpec


def combine(sections: list[dict[str, Any]], drop: tuple[int, ...] = (), why: str = "") -> dict[str, Any]:
    """One report's section from the runs of several of the same workload (their repeats numbered on in order),
    less the repeats in `drop` (1-based, after numbering; e.g. one the machine was disturbed in, said in `why`):
    medians and targets computed again, the dropped runs kept aside. The simulator's mirror is left out (re-run it
    with `mirror`)."""
    if not sections:
        raise ValueError("nothing to combine")
    first = RealSpec.recorded(sections[0]["spec"])
    runs: list[dict[str, Any]] = []
    for section in sections:
        spec = RealSpec.recorded(section["spec"])
        if replace(spec, strategies=first.strategies, repeats=first.repeats) != first:
            raise ValueError(f"runs of different workloads cannot be combined: {asdict(spec)} vs {asdict(first)}")
        offset = 1 + max((r["repeat"] for r in runs), default=-1)
        runs += [{**r, "repeat": r["repeat"] + offset} for r in section["runs"]]
    kept = [r for r in runs if r["repeat"] + 1 not in drop]
    strategies = tuple(dict.fromkeys(r["strategy"] for r in runs))
    spec = replace(first, strategies=strategies, repeats=len({r["repeat"] for r in kept}))
    summary = medians(kept, strategies)
    return {"spec": asdict(spec) | {"requests": spec.requests}, "calibration": sections[0]["calibration"],
            "runs": kept, "medians": summary, "targets": targets(summary, spec.workload),
            "dropped": {"repeats": sorted(drop), "why": why, "runs": [r for r in runs if r["repeat"] + 1 in drop]}}


_FIGURES = ("hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "failed", "warm_share",
            "ttft_warm_p50_ms", "ttft_cold_p50_ms")


def medians(runs: list[dict[str, Any]], strategies: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for s in strategies:
        mine = [r for r in runs if r["strategy"] == s and "error" not in r]
        if not mine:
            continue
        row: dict[str, Any] = {k: statistics.median(r[k] for r in mine) for k in _FIGURES}
        row["runs"] = len(mine)
        for figure in ("ttft_mean_ms", "ttft_p90_ms", "hit_rate"):
            row[f"{figure}_range"] = [min(r[figure] for r in mine), max(r[figure] for r in mine)]
        row["max_share"] = statistics.median(max(r["share"]) for r in mine)
        row["server_cpu_share"] = statistics.median(sum(r["server_cpu_share"]) / len(r["server_cpu_share"])
                                                    for r in mine)
        row["api_server_cpu_share"] = statistics.median(
            sum(r["api_server_cpu_share"]) / len(r["api_server_cpu_share"]) for r in mine)
        row["metrics_requests_per_pod_per_s"] = statistics.median(
            max(r["metrics_requests_per_pod_per_s"] or [0.0]) for r in mine)
        measured = [r["router_cpu_share"] for r in mine if "router_cpu_share" in r]  # runs since 2026-12-05
        row["router_cpu_share"] = statistics.median(measured) if measured else math.nan
        row.update(held_medians(mine))
        out[s] = row
    return out


# Per workload, what the picker is held to against the better hash baseline (figure by figure): at most `factor`
# times its TTFT figures, at least its hit rate (factor unused). Hot prefixes are where hashing fails; every router
# is warm there, so hit rates are not compared.
HASH_TARGETS: dict[str, dict[str, float]] = {
    "uniform": {"ttft_mean_ms": 1.0, "ttft_p90_ms": 1.0, "hit_rate": 1.0},
    "pressure": {"ttft_mean_ms": 1.0, "ttft_p90_ms": 1.0, "hit_rate": 1.0},
    "hot": {"ttft_mean_ms": 0.85, "ttft_p90_ms": 0.85},
    "multi-turn": {"ttft_p90_ms": 0.85},
    "leave-rejoin": {"ttft_p90_ms": 0.85},
}
_FIGURE_LABELS = {"ttft_mean_ms": "TTFT mean", "ttft_p90_ms": "TTFT p90", "hit_rate": "hit rate"}


def targets(m: dict[str, dict[str, Any]], workload: str = "uniform") -> list[dict[str, Any]]:
    """The workload's acceptance figures against the better of the hash baselines (the lower median, figure by
    figure) and round-robin, each with what was measured. Noise is what the report's ranges show."""
    out: list[dict[str, Any]] = []

    def add(name: str, met: bool, measured: str) -> None:
        out.append({"target": name, "met": bool(met), "measured": measured})

    pk, rr = m.get("picker"), m.get("round-robin")
    hashes = {name: m[name] for name in HASH_BASELINES if name in m}
    bounds = HASH_TARGETS.get(workload, HASH_TARGETS["uniform"])
    if pk and hashes:
        for figure, factor in bounds.items():
            label = _FIGURE_LABELS[figure]
            if figure == "hit_rate":
                best = max(hashes, key=lambda name: hashes[name][figure])
                add(f"picker {label} >= the better hash baseline's", pk[figure] >= hashes[best][figure],
                    f"{pk[figure]:.3f} vs {best} {hashes[best][figure]:.3f}")
                continue
            best = min(hashes, key=lambda name: hashes[name][figure])
            add(f"picker {label} <= {factor:g}x the better hash baseline's", pk[figure] <= factor * hashes[best][figure],
                f"{pk[figure]:.1f} vs {best} {hashes[best][figure]:.1f} ms ({pk[figure] / hashes[best][figure]:.2f}x)")
    if pk and rr and workload == "hot":
        for figure in ("ttft_mean_ms", "ttft_p90_ms"):
            add(f"picker {_FIGURE_LABELS[figure]} <= round-robin's", pk[figure] <= rr[figure],
                f"{pk[figure]:.1f} vs {rr[figure]:.1f} ms ({pk[figure] / rr[figure]:.2f}x)")
    pt, ph = m.get("picker-predicted-ttft"), m.get("prefix-hash")
    if pt and ph:
        add("predicted-ttft picker TTFT mean < prefix-hash's", pt["ttft_mean_ms"] < ph["ttft_mean_ms"],
            f"{pt['ttft_mean_ms']:.1f} vs {ph['ttft_mean_ms']:.1f} ms")
    p4 = m.get("picker-4-replicas")
    if pk and p4:
        # 5 %: a run's scrape count over its wall time jitters by a scrape or two
        add("/metrics requests per pod per s at 4 replicas <= at 1 replica (within 5 %)",
            p4["metrics_requests_per_pod_per_s"] <= pk["metrics_requests_per_pod_per_s"] * 1.05,
            f"{p4['metrics_requests_per_pod_per_s']:.2f} vs {pk['metrics_requests_per_pod_per_s']:.2f}")
    return out
