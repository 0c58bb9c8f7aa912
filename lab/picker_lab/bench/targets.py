"""The project's routing targets (issue #5), checked against the figures of this run — met or missed, with numbers."""

from __future__ import annotations

import math
from typing import Any

TARGET_WORKLOADS = ("shared-prefix", "multi-turn")
LOAD_RANGE = (0.7, 0.85)


def _check(name: str, workload: str, value: float, threshold: float, met: bool, detail: str) -> dict[str, Any]:
    ok = bool(met) and not math.isnan(value)
    return {"target": name, "workload": workload, "value": value, "threshold": threshold, "met": ok,
            "detail": detail}


def evaluate_fast(main: dict[str, dict[str, dict[str, Any]]], calibration: dict[str, dict[str, float]]
                  ) -> list[dict[str, Any]]:
    """Targets on the fast-mode main table (only where both the picker and round-robin ran)."""
    out: list[dict[str, Any]] = []
    for w in TARGET_WORKLOADS:
        rows = main.get(w, {})
        pk, rr = rows.get("picker"), rows.get("round-robin")
        if not pk or not rr:
            continue
        load = calibration.get(w, {}).get("load", math.nan)
        where = f"load {load:.2f}" + ("" if LOAD_RANGE[0] <= load <= LOAD_RANGE[1] else " (outside the 0.70-0.85 target range)")
        ratio = pk["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
        out.append(_check("hit rate >= 2x round-robin", w, ratio, 2.0, ratio >= 2.0,
                          f"{pk['hit_rate']:.3f} vs {rr['hit_rate']:.3f}, {where}"))
        of = pk["hit_rate_of_oracle"]
        out.append(_check("hit rate >= 90% of the oracle", w, of, 0.9, of >= 0.9,
                          f"{pk['hit_rate']:.3f} vs oracle {pk['oracle_hit_rate']:.3f}"))
        red = 1 - pk["ttft_mean"] / rr["ttft_mean"]
        out.append(_check("TTFT mean >= 35% lower than round-robin", w, red, 0.35, red >= 0.35,
                          f"{pk['ttft_mean'] * 1e3:.1f} ms vs {rr['ttft_mean'] * 1e3:.1f} ms, {where}"))
        red95 = 1 - pk["ttft_p95"] / rr["ttft_p95"]
        out.append(_check("TTFT p95 >= 52% lower than round-robin", w, red95, 0.52, red95 >= 0.52,
                          f"{pk['ttft_p95'] * 1e3:.1f} ms vs {rr['ttft_p95'] * 1e3:.1f} ms, {where}"))
    zipf = main.get("zipf-prefix", {})
    if "picker" in zipf and "round-robin" in zipf:
        pk, rr = zipf["picker"], zipf["round-robin"]
        extra = pk["cold_share"] - pk["oracle_cold_share"]
        out.append(_check("zipf-prefix cold share <= the oracle's + 2 points", "zipf-prefix", extra, 0.02,
                          extra <= 0.02, f"{pk['cold_share']:.3f} vs oracle {pk['oracle_cold_share']:.3f}"))
        ratio = pk["ttft_p90"] / rr["ttft_p90"]
        out.append(_check("zipf-prefix TTFT p90 <= 0.7x round-robin", "zipf-prefix", ratio, 0.7, ratio <= 0.7,
                          f"{pk['ttft_p90'] * 1e3:.1f} ms vs {rr['ttft_p90'] * 1e3:.1f} ms"))
    hot = main.get("hot-prefix", {})
    if "picker" in hot and "least-load" in hot:
        p, ll = hot["picker"]["ttft_p95"], hot["least-load"]["ttft_p95"]
        out.append(_check("hot-prefix p95 TTFT no worse than least-load", "hot-prefix", p / ll, 1.0, p <= ll,
                          f"{p * 1e3:.1f} ms vs {ll * 1e3:.1f} ms"))
    return out


def evaluate_live(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Live mode: ahead of each peer router on p95 TTFT at equal or better hit rate."""
    out: list[dict[str, Any]] = []
    pk = rows.get("picker")
    if not pk:
        return out
    for peer in ("sglang-router", "vllm-router"):
        row = rows.get(peer)
        if not row:
            continue
        faster = pk["ttft_p95"] < row["ttft_p95"]
        hits = pk["hit_rate"] >= row["hit_rate"] - 0.01
        a, b = pk.get("ttft_p95_ci95") or [None, None], row.get("ttft_p95_ci95") or [None, None]
        overlap = None not in (*a, *b) and a[0] <= b[1] and b[0] <= a[1]
        noise = "; the 95 % intervals overlap: not resolved by this run" if overlap else ""
        out.append(_check(f"ahead of {peer} on p95 TTFT at equal or better hit rate", "live", pk["ttft_p95"] /
                          row["ttft_p95"], 1.0, faster and hits,
                          f"p95 {pk['ttft_p95'] * 1e3:.1f} vs {row['ttft_p95'] * 1e3:.1f} ms, hit rate "
                          f"{pk['hit_rate']:.3f} vs {row['hit_rate']:.3f}{noise}"))
    return out


def evaluate_sweep(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (target workload, load) of the sweep: the picker's figures against round-robin's at the same load,
    so the report can say from which load on each target is met."""
    out: list[dict[str, Any]] = []
    by_key = {(r["workload"], r["load"], r["strategy"]): r for r in sweep}
    for (w, load, s), pk in sorted(by_key.items()):
        rr = by_key.get((w, load, "round-robin"))
        if s != "picker" or rr is None or w not in TARGET_WORKLOADS:
            continue
        hit_x = pk["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
        of_oracle = pk["hit_rate"] / pk["oracle_hit_rate"] if pk["oracle_hit_rate"] else math.nan
        mean_red = 1 - pk["ttft_mean"] / rr["ttft_mean"]
        p95_red = 1 - pk["ttft_p95"] / rr["ttft_p95"]
        out.append({"workload": w, "load": load, "hit_rate_x_rr": hit_x, "hit_rate_of_oracle": of_oracle,
                    "ttft_mean_reduction": mean_red, "ttft_p95_reduction": p95_red,
                    "all_met": hit_x >= 2 and of_oracle >= 0.9 and mean_red >= 0.35 and p95_red >= 0.52})
    return out
