"""Issue 10's fast-mode target, counted: in how many (workload, load) cells is a predicted-TTFT variant within 2 %
of the best of today's defaults, GIE's emulated defaults and prefix-hash, on TTFT mean and on p90?

    .venv/bin/python bench/predicted_priors.py [--seed 1] [--grid] [--loads 0.5,0.8,1.0]

Without `--grid`: the shipped priors (`predicted-ttft`), the same without the eviction price, and the first,
per-token-only model. With it, also the
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

from picker.bench.suite import FastSpec  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--loads", default="0.5,0.8,1.0")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--grid", action="store_true", help="also the priors around the shipped ones")
    args = parser.parse_args()
    extra = grid() if args.grid else {}
    names = ["predicted-ttft", "predicted-ttft no eviction price", "predicted-ttft per-token only", *extra]
    loads = [float(x) for x in args.loads.split(",")]
    missed: dict[str, list[str]] = {n: [] for n in names}
    for load in loads:
        base = FastSpec(pods=8, workloads=WORKLOADS, load=load, requests=args.requests, seed=args.seed,
                        sweep_workloads=(), capacity_workload=None)
        rows = sweep(base, ["defaults", "GIE defaults (emulated)", *names], extra)
        for n in names:
            missed[n] += [f"{m} at {load:g}" for m in misses(rows, n)]
    cells = len(WORKLOADS) * len(loads)
    print(f"Fast mode, 8 pods, {args.requests} requests, seed {args.seed}, loads {args.loads}: cells within 2 % of "
          "the best of the defaults, GIE's emulation and prefix-hash on TTFT mean and p90 (misses: mean/p90 ratio)\n")
    print("| variant | cells | misses |\n|---|---:|---|")
    for n in names:
        print(f"| {n} | {cells - len(missed[n])} of {cells} | {'; '.join(missed[n]) or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
