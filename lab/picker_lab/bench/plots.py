"""PNG plots drawn from the report's own data (so a plot never shows a number the report does not hold)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"round-robin": "#888888", "random": "#bbbb44", "least-load": "#4477aa", "prefix-only": "#cc8833",
          "picker": "#cc2222", "sglang-router": "#44aa77", "vllm-router": "#8855bb"}


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (the Agg backend, no display), for every plot of the lab."""
    return plt


def _color(strategy: str) -> str:
    return COLORS.get(strategy, "#333333")


def ttft_cdf(path: Path, title: str, cdf: dict[str, list[float]]) -> Path:
    """TTFT CDF per strategy (x: seconds, log scale)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for strategy, quantiles in cdf.items():
        if quantiles:
            ys = [i / (len(quantiles) - 1) for i in range(len(quantiles))]
            ax.plot([max(q, 1e-4) for q in quantiles], ys, label=strategy, color=_color(strategy),
                    linewidth=2.2 if strategy == "picker" else 1.4)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep(path: Path, workload: str, rows: list[dict[str, Any]]) -> Path:
    """Hit rate and p95 TTFT vs offered load, one line per strategy."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.0))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    for s in strategies:
        pts = sorted((r["load"], r["hit_rate"], r["ttft_p95"]) for r in rows if r["strategy"] == s)
        loads = [p[0] for p in pts]
        ax1.plot(loads, [p[1] for p in pts], marker="o", label=s, color=_color(s))
        ax2.plot(loads, [p[2] for p in pts], marker="o", label=s, color=_color(s))
    oracle = sorted((r["load"], r["oracle_hit_rate"]) for r in rows if r["strategy"] == strategies[0])
    if oracle:
        ax1.plot([o[0] for o in oracle], [o[1] for o in oracle], linestyle="--", color="black", label="oracle")
    ax1.set_xlabel("offered load (of cache-blind capacity)")
    ax1.set_ylabel("prefix-cache hit rate (tokens)")
    ax1.set_ylim(0, 1)
    ax2.set_xlabel("offered load (of cache-blind capacity)")
    ax2.set_ylabel("p95 TTFT (s)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{workload}: hit rate and p95 TTFT vs offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pod_load(path: Path, workload: str, series: dict[str, dict[str, Any]]) -> Path:
    """Per-pod outstanding requests over time, one panel per strategy."""
    n = len(series)
    fig, axes = plt.subplots(n, 1, figsize=(8, 1.7 * n + 0.6), sharex=True, squeeze=False)
    for ax, (strategy, data) in zip(axes[:, 0], series.items(), strict=True):
        t = data["t"]
        per_pod = data["per_pod"]
        if per_pod:
            for k in range(len(per_pod[0])):
                ax.plot(t, [row[k] for row in per_pod], linewidth=0.8)
        ax.set_ylabel(strategy, fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(f"{workload}: requests running + waiting on each pod")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
