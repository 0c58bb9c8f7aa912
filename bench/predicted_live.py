"""Issue 10's live target, counted: the predicted-TTFT picker beside the defaults and prefix-hash, live, on each
(workload, load): TTFT mean and p90, and its ratio to the better of the two.

    .venv/bin/python bench/predicted_live.py [--workloads chat,code] [--loads 0.5,1.0] [--requests 400]

Each cell is one `picker bench --mode live` run (4 `picker sim` pods, Envoy, the three pickers one after another
on the same trace; ~2-3 minutes); reports land in bench/out/predicted-live/<workload>-<load>/. Live runs on a
shared machine are noisy: each report has the bootstrap intervals to judge a difference by.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WORKLOADS = ("chat", "code", "multi-turn", "summarize", "shared-prefix", "bursty", "hot-prefix")
PICKERS = ("prefix-hash", "picker", "picker-predicted-ttft")
OUT = Path("bench") / "out" / "predicted-live"


def run_cell(workload: str, load: float, requests: int) -> dict[str, dict[str, float]]:
    out = OUT / f"{workload}-{load:g}"
    subprocess.run([sys.executable, "-m", "picker", "bench", "--mode", "live", "--strategies", ",".join(PICKERS),
                    "--live-requests", str(requests), "--live-load", str(load), "--live-workload", workload,
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    strategies: dict[str, dict[str, float]] = json.loads((out / "report.json").read_text())["live"]["strategies"]
    return strategies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default="0.5,1.0")
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    print("Live, 4 sim pods, one run per cell: TTFT mean / p90 ms for prefix-hash, the defaults and predicted TTFT; "
          "the last column is predicted TTFT's mean / p90 over the better of the other two\n")
    print("| workload | load | prefix-hash | defaults | predicted TTFT | ratio |\n|---|---:|---|---|---|---:|")
    for load in (float(x) for x in args.loads.split(",")):
        for w in args.workloads.split(","):
            s = run_cell(w, load, args.requests)
            cells = [f"{s[p]['ttft_mean'] * 1e3:.1f} / {s[p]['ttft_p90'] * 1e3:.1f}" for p in PICKERS]
            mine = s["picker-predicted-ttft"]
            best_mean = min(s[p]["ttft_mean"] for p in PICKERS[:2])
            best_p90 = min(s[p]["ttft_p90"] for p in PICKERS[:2])
            print(f"| {w} | {load:g} | {' | '.join(cells)} | {mine['ttft_mean'] / best_mean:.2f} / "
                  f"{mine['ttft_p90'] / best_p90:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
