"""Figures of one run (percentiles, hit rates, imbalance, cost) and ratios to round-robin from the same run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from picker_lab.bench.results import FAILED, OK, SHED, RunResult

# Figures every strategy row carries; the report checks it is complete.
FIGURES = (
    "requests", "completed", "shed", "failed", "hit_rate", "vllm_hit_rate", "oracle_hit_rate", "hit_rate_of_oracle",
    "oracle_cold_share",
    "ttft_mean", "ttft_p50", "ttft_p95", "ttft_p99", "e2e_mean", "e2e_p95", "itl_mean", "itl_p95",
    "output_tokens_per_s", "load_imbalance", "served_imbalance", "busy_s_per_1k", "preemptions", "duration_s",
)
LOWER_IS_BETTER = frozenset({"ttft_mean", "ttft_p50", "ttft_p95", "ttft_p99", "e2e_mean", "e2e_p95", "itl_mean",
                             "itl_p95", "load_imbalance", "served_imbalance", "busy_s_per_1k", "shed", "failed"})


def percentile(values: np.ndarray | Sequence[float], q: float) -> float:
    """The q-th percentile (0-100, numpy's linear interpolation) of the values; NaN for none."""
    array = np.asarray(values, dtype=float)
    return float(np.percentile(array, q)) if array.size else math.nan


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The value at rank q (0-1) of the sorted values, no interpolation (a latency a request really had); None for
    none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else math.nan


def load_imbalance(load_per_pod: list[list[int]]) -> float:
    """Time-averaged max/mean of per-pod outstanding requests (running + waiting), over samples with load.
    1.0 = perfectly even; a pod holding twice its share gives 2.0."""
    ratios = []
    for sample in load_per_pod:
        total = sum(sample)
        if total:
            ratios.append(max(sample) * len(sample) / total)
    return float(np.mean(ratios)) if ratios else math.nan


def _cold_share(res: RunResult) -> float:
    """Share of sent requests whose oracle hit is under half of their prompt."""
    pairs = [(o, p) for o, p in zip(res.oracle_cached, res.prompt_tokens, strict=True) if p > 0]
    return sum(1 for o, p in pairs if o < p / 2) / len(pairs) if pairs else math.nan


def _served_cold_share(res: RunResult) -> float:
    """Share of completed requests that were served from cache for under half of their prompt."""
    pairs = [(c, p) for c, p, s in zip(res.cached_tokens, res.prompt_tokens, res.status, strict=True)
             if s == OK and p > 0]
    return sum(1 for c, p in pairs if c < p / 2) / len(pairs) if pairs else math.nan


def bootstrap_ci(values: np.ndarray, stat: str, resamples: int = 400, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of the mean or the p95 (resampling requests): how much of a difference between two
    strategies a run of this size can resolve."""
    if values.size < 2:
        return [math.nan, math.nan]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(resamples, values.size))
    samples = values[idx]
    stats = samples.mean(axis=1) if stat == "mean" else np.percentile(samples, 95, axis=1)
    return [float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))]


def summarize(res: RunResult) -> dict[str, Any]:
    """Every figure of one (workload, strategy) run, as plain floats/ints for JSON."""
    status = np.array(res.status)
    ok = status == OK
    ttft = np.array(res.ttft)[ok]
    ttft = ttft[~np.isnan(ttft)]
    e2e = np.array(res.e2e)[ok]
    itl = np.array(res.itl)[ok]
    itl = itl[~np.isnan(itl)]
    served = [s for s in res.pod_served]
    completed = int(ok.sum())
    oracle = res.oracle_hits / res.oracle_queries if res.oracle_queries else math.nan
    hit = res.prompt_tokens_cached / res.prompt_tokens_total if res.prompt_tokens_total else math.nan
    return {
        "requests": res.n,
        "completed": completed,
        "shed": int((status == SHED).sum()),
        "failed": int((status == FAILED).sum()),
        "hit_rate": hit,
        "vllm_hit_rate": res.prefix_hits / res.prefix_queries if res.prefix_queries else math.nan,
        "oracle_hit_rate": oracle,
        "hit_rate_of_oracle": hit / oracle if oracle and oracle > 0 else math.nan,
        # requests no router can serve mostly from cache: their TTFT is a full prefill under any routing
        "oracle_cold_share": _cold_share(res),
        "cold_share": _served_cold_share(res),
        "ttft_mean": _mean(ttft),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p95": percentile(ttft, 95),
        "ttft_p99": percentile(ttft, 99),
        "ttft_mean_ci95": bootstrap_ci(ttft, "mean") if ttft.size <= 20_000 else [math.nan, math.nan],
        "ttft_p95_ci95": bootstrap_ci(ttft, "p95") if ttft.size <= 20_000 else [math.nan, math.nan],
        "e2e_mean": _mean(e2e),
        "e2e_p95": percentile(e2e, 95),
        "itl_mean": _mean(itl),
        "itl_p95": percentile(itl, 95),
        "output_tokens_per_s": sum(res.output_tokens) / res.duration_s if res.duration_s > 0 else math.nan,
        "load_imbalance": load_imbalance(res.load_per_pod),
        "served_imbalance": max(served) * len(served) / sum(served) if served and sum(served) else math.nan,
        "busy_s_per_1k": sum(res.pod_busy_s) / completed * 1000 if completed and res.pod_busy_s else math.nan,
        "preemptions": res.preemptions,
        "duration_s": res.duration_s,
    }


def ratios_to(baseline: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """row / baseline for every numeric figure (NaN when the baseline is 0 or missing)."""
    out: dict[str, float] = {}
    for key in FIGURES:
        b, v = baseline.get(key), row.get(key)
        if isinstance(b, int | float) and isinstance(v, int | float) and b and not math.isnan(b):
            out[key] = float(v) / float(b)
        else:
            out[key] = math.nan
    return out


def ttft_sample(res: RunResult, limit: int = 5000) -> list[float]:
    """Sorted TTFTs of completed requests, thinned to at most `limit` points (for CDF plots)."""
    values = sorted(t for t, s in zip(res.ttft, res.status, strict=True) if s == OK and not math.isnan(t))
    if len(values) <= limit:
        return values
    step = len(values) / limit
    return [values[int(i * step)] for i in range(limit)]
