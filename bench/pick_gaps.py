"""How often a router sends a request to a pod it chose a moment before, and what that costs the request's TTFT.

    .venv/bin/python bench/pick_gaps.py [--workload chat] [--load 0.5] [--variants "round-robin,defaults,..."]

Fast mode, the same seeded trace for every variant (the names of bench/run_scheduling_sweep.py, plus round-robin
and prefix-hash). For each request, the gap is the time since the previous request was sent to the same pod; the
table gives the share of requests sent within 10 ms of the previous one and the mean TTFT per gap range. A short
prefill costs an engine step whatever its length, so a request that lands on a pod just handed another one waits
for that step: the reason the predicted-TTFT scorer prices a prefill with a fixed part (bench/studies/predicted-ttft.md,
"Predicted TTFT").
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_scheduling_sweep import BASELINES, VARIANTS, scheduling_spec  # noqa: E402

from picker_lab.bench.results import RunResult  # noqa: E402
from picker_lab.bench.suite import Cell, FastSpec, calibrate, replay  # noqa: E402

GAPS_MS = ((0, 5), (5, 10), (10, 20), (20, math.inf))


def gaps(res: RunResult) -> list[float]:
    """Per request, seconds since the previous request sent to the same pod (inf for a pod's first)."""
    last: dict[int, float] = {}
    out = [math.inf] * len(res.sent)
    for i in sorted(range(len(res.sent)), key=res.sent.__getitem__):
        k = res.pod[i]
        if k < 0:
            continue
        if k in last:
            out[i] = res.sent[i] - last[k]
        last[k] = res.sent[i]
    return out


def row(name: str, res: RunResult) -> str:
    gap = gaps(res)
    served = [i for i, t in enumerate(res.ttft) if not math.isnan(t)]
    ttfts = sorted(res.ttft[i] for i in served)
    close = sum(1 for i in served if gap[i] < 0.010) / len(served)
    cells = []
    for lo, hi in GAPS_MS:
        group = [res.ttft[i] for i in served if lo <= gap[i] * 1e3 < hi]
        cells.append(f"{sum(group) / len(group) * 1e3:.1f} ms ({len(group)})" if group else "-")
    return (f"| {name} | {sum(ttfts) / len(ttfts) * 1e3:.1f} / {ttfts[int(0.9 * len(ttfts))] * 1e3:.1f} | "
            f"{close * 100:.1f} % | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--load", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", default="round-robin,defaults,predicted-ttft per-token only,predicted-ttft")
    args = parser.parse_args()
    base = FastSpec(pods=args.pods, workloads=(args.workload,), load=args.load, requests=args.requests,
                    seed=args.seed, sweep_workloads=(), capacity_workload=None)
    rate = calibrate(base)[args.workload]["rate_rps"]
    print(f"Fast mode, {args.workload}, {args.pods} pods, load {args.load}, {args.requests} requests, seed "
          f"{args.seed}. Mean TTFT per gap since the pod's previous request (requests in brackets).\n")
    print("| variant | TTFT mean / p90 ms | sent < 10 ms after the pod's previous | " +
          " | ".join(f"gap {lo}-{hi} ms" for lo, hi in GAPS_MS) + " |")
    print("|---|---:|---:|" + "---:|" * len(GAPS_MS))
    for name in args.variants.split(","):
        strategy = name if name in BASELINES else "picker"
        spec = base if strategy != "picker" else replace(base, scheduling=scheduling_spec(VARIANTS[name]))
        res = replay(spec, Cell("main", args.workload, strategy, args.requests, rate, args.load, args.pods))
        print(row(name, res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
