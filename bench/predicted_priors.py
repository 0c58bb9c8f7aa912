"""Issue 10's fast-mode target, counted: in how many (workload, load) cells is a predicted-TTFT variant within 2 %
of the best of today's defaults, GIE's emulated defaults and prefix-hash, on TTFT mean and on p90?

    .venv/bin/python bench/predicted_priors.py [--seeds 1,2] [--grid] [--cells] [--loads 0.5,0.8,1.0]

Without `--grid`: the shipped model (`predicted-ttft`), the same without copy demand (every cold copy charged
whole to its request), without the eviction price, and the first, per-token-only model. With it, also the
priors around the shipped ones (fixed 5 / 7.5 / 10 ms x 25,000 / 35,000 tokens/s x decode 4 / 8), to show how
narrow the optimum is. Fast mode, 8 pods, 3,000 requests per cell, the seven workloads; ~1 minute per load
without the grid on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_scheduling_sweep import predicted_ttft, sweep  # noqa: E402

from picker_lab.bench.suite import FastSpec  # noqa: E402

REFERENCES = ("defaults", "GIE defaults (emulated)", "prefix-hash")
WORKLOADS = ("chat", "code", "multi-turn", "summarize", "shared-prefix", "bursty", "hot-prefix")
SLACK = 1.02


def grid() -> dict[str, dict[str, Any]]:
    return {f"predicted-ttft {fixed * 1e3:g} ms {rate // 1000}k decode {decode}": predicted_ttft(
        prefillFixedSeconds=fixed, prefillTokensPerSecond=rate, decodeTokens=decode)
        for fixed in (0.005, 0.0075, 0.01) for rate in (25_000, 35_000) for decode in (4, 8)}


def misses(rows: dict[tuple[str, str], dict[str, Any]], name: str) -> list[str]:
    """The workloads where `name` is more than 2 % behind the best reference on mean or p90, with its ratios."""
    out = []
    for w in WORKLOADS:
        mean = rows[(name, w)]["ttft_mean"] / min(rows[(r, w)]["ttft_mean"] for r in REFERENCES)
        p90 = rows[(name, w)]["ttft_p90"] / min(rows[(r, w)]["ttft_p90"] for r in REFERENCES)
        if mean > SLACK or p90 > SLACK:
            out.append(f"{w} {mean:.3f}/{p90:.3f}")
    return out


def cells_table(rows_by_load: dict[float, dict[tuple[str, str], dict[str, Any]]], name: str) -> str:
    """`name`'s TTFT mean / p90 per (workload, load), with its ratios to the best reference in brackets."""
    loads = list(rows_by_load)
    lines = ["| workload | " + " | ".join(f"load {x:g}" for x in loads) + " |", "|---|" + "---:|" * len(loads)]
    for w in WORKLOADS:
        cells = []
        for load in loads:
            rows = rows_by_load[load]
            mine = rows[(name, w)]
            best_mean = min(rows[(r, w)]["ttft_mean"] for r in REFERENCES)
            best_p90 = min(rows[(r, w)]["ttft_p90"] for r in REFERENCES)
            cells.append(f"{mine['ttft_mean'] * 1e3:.1f} / {mine['ttft_p90'] * 1e3:.1f} "
                         f"({mine['ttft_mean'] / best_mean:.2f} / {mine['ttft_p90'] / best_p90:.2f})")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1", help="comma-separated; each seed is a fresh set of traces")
    parser.add_argument("--loads", default="0.5,0.8,1.0")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--grid", action="store_true", help="also the priors around the shipped ones")
    parser.add_argument("--cells", action="store_true",
                        help="also predicted-ttft's mean / p90 per cell (the first seed), ratios to the best reference")
    args = parser.parse_args()
    extra = grid() if args.grid else {}
    names = ["predicted-ttft", "predicted-ttft no copy demand", "predicted-ttft no eviction price",
             "predicted-ttft per-token only", *extra]
    loads = [float(x) for x in args.loads.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    missed: dict[str, dict[int, list[str]]] = {n: {seed: [] for seed in seeds} for n in names}
    first: dict[float, dict[tuple[str, str], dict[str, Any]]] = {}
    for seed in seeds:
        for load in loads:
            base = FastSpec(pods=8, workloads=WORKLOADS, load=load, requests=args.requests, seed=seed,
                            sweep_workloads=(), capacity_workload=None)
            rows = sweep(base, ["defaults", "GIE defaults (emulated)", *names], extra)
            if seed == seeds[0]:
                first[load] = rows
            for n in names:
                missed[n][seed] += [f"{m} at {load:g}" for m in misses(rows, n)]
    cells = len(WORKLOADS) * len(loads)
    print(f"Fast mode, 8 pods, {args.requests} requests, seeds {args.seeds}, loads {args.loads}: cells within 2 % of "
          "the best of the defaults, GIE's emulation and prefix-hash on TTFT mean and p90, per seed (misses: "
          "mean/p90 ratio)\n")
    print("| variant | cells | misses |\n|---|---:|---|")
    for n in names:
        counts = ", ".join(str(cells - len(missed[n][seed])) for seed in seeds)
        total = sum(cells - len(missed[n][seed]) for seed in seeds)
        listed = "; ".join(f"seed {seed}: {', '.join(m)}" for seed, m in missed[n].items() if m) or "-"
        print(f"| {n} | {counts} ({total} of {cells * len(seeds)}) | {listed} |")
    if args.cells:
        print(f"\npredicted-ttft, TTFT mean / p90 ms (ratio to the best reference), seed {seeds[0]}:\n")
        print(cells_table(first, "predicted-ttft"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
