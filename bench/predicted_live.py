"""Issue 10's live target, counted: the predicted-TTFT picker beside the defaults and prefix-hash, live, on each
(workload, load): TTFT mean and p90 (medians over repeats), and its ratio to the better of the two.

    .venv/bin/python bench/predicted_live.py [--workloads chat,code] [--loads 0.5,1.0] [--requests 400]
                                             [--repeats 3] [--time-scale 0.25]

Each repeat of a cell is one `picker bench --mode live` run (4 `picker sim` pods, Envoy, the three pickers one after
another on the same trace, on a fresh fleet); odd repeats run the pickers in reverse order, so no picker always
goes first. Two runs of one picker on one cell differ by far more than 2 % on a shared machine, so the table gives
each picker's spread over its repeats, (max - min) / median: a ratio within that spread of 1 is a tie, not a win
or a loss. The pickers of one run share the machine's mood, so the ratio is also given run by run (the lowest and
highest over the repeats): a ratio on the same side of 1 in every run is a difference. `--time-scale` slows the
simulated pods' clock against the wall (fewer requests a wall second): on a slow machine at load 1.0 the host, not
the pods, can be the bottleneck (model-time TTFT then grows with the time scale); figures that do not change when
it is halved are the pods'. Reports land in bench/out/predicted-live/<workload>-<load>-<repeat>/; `--tabulate`
prints the table from them without running.

`--pod-clock` runs, instead, predicted TTFT told the sim pods' time scale (`podTimeScale`, as `picker bench` sets it)
against the same profile left at 1, side by side on each cell: what keeping its queues on the pods' clock is worth
(reports in bench/out/predicted-live/pod-clock-<workload>-<load>-<repeat>/).

`--peers` runs, instead, the defaults and predicted TTFT against sglang-router and vllm-router (cache-aware, each in
its own venv, installed on first use) on the issue's cells: shared-prefix, multi-turn and hot-prefix at load 0.8,
600 requests (the routers' order reversed every other run, peers included). It prints each router's TTFT mean, p90
(median and the lowest and highest run), hit rate and cold share (with the oracle's: requests cold under any
routing, whose full prefill is what a p90 above that share measures), then predicted TTFT's p90 over each peer's:
the ratio of the medians, the ratio run by run, and whether the runs' ranges are disjoint (reports in
bench/out/predicted-live/peers-<workload>-<load>-<repeat>/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from picker_lab.bench.configs import PREDICTED_TTFT_CONFIG
from picker_lab.bench.peers import PEERS

WORKLOADS = ("chat", "code", "multi-turn", "summarize", "shared-prefix", "bursty", "hot-prefix")
PICKERS = ("prefix-hash", "picker", "picker-predicted-ttft")
METRICS = ("ttft_mean", "ttft_p90")
PEER_ROUTERS = ("picker", "picker-predicted-ttft", *PEERS)
DEFAULT_CELLS: dict[str, object] = {"workloads": ",".join(WORKLOADS), "loads": "0.5,1.0", "requests": 400}
PEER_CELLS: dict[str, object] = {"workloads": "shared-prefix,multi-turn,hot-prefix", "loads": "0.8", "requests": 600}
OUT = Path("bench") / "out" / "predicted-live"


def run_once(workload: str, load: float, requests: int, repeat: int, time_scale: float | None,
             tabulate: bool, pickers: tuple[str, ...] = PICKERS, scheduling: str | None = None,
             name: str = "") -> dict[str, dict[str, float]]:
    out = OUT / f"{name}{workload}-{load:g}-{repeat}"
    if tabulate:
        return read(out)
    order = pickers if repeat % 2 == 0 else pickers[::-1]
    cmd = [sys.executable, "-m", "picker", "bench", "--mode", "live", "--strategies", ",".join(order),
           "--live-requests", str(requests), "--live-load", str(load), "--live-workload", workload, "--out", str(out)]
    if time_scale:
        cmd += ["--live-time-scale", str(time_scale)]
    if scheduling:
        cmd += ["--scheduling", scheduling]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return read(out)


def read(out: Path) -> dict[str, dict[str, float]]:
    strategies: dict[str, dict[str, float]] = json.loads((out / "report.json").read_text())["live"]["strategies"]
    return strategies


def spread(values: list[float]) -> float:
    """(max - min) / median of one picker's repeats: how far apart two runs of the same thing land."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def medians(runs: list[dict[str, dict[str, float]]], pickers: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each picker's TTFT mean and p90, medians over the runs."""
    return {p: {m: statistics.median(run[p][m] for run in runs) for m in METRICS} for p in pickers}


def cell(figures: dict[str, float]) -> str:
    return f"{figures['ttft_mean'] * 1e3:.1f} / {figures['ttft_p90'] * 1e3:.1f}"


def lowest_highest(per_run: list[list[float]]) -> str:
    """The lowest and highest per-run ratio of mean, then of p90."""
    return " / ".join(f"{min(r):.2f}-{max(r):.2f}" for r in per_run)


def pod_clock(args: argparse.Namespace) -> None:
    """Predicted TTFT at podTimeScale 1 (run as the `picker` strategy) against the same at the pods' scale."""
    print(f"Live, 4 sim pods, {args.repeats} run(s) per cell, time scale {args.time_scale or 0.5}: predicted TTFT's "
          "TTFT mean / p90 ms (medians over the runs) left at podTimeScale 1 and told the pods' scale; the ratio of "
          "the second to the first, of the medians and the lowest and highest of one run\n")
    print("| workload | load | podTimeScale 1 | the pods' scale | ratio | ratio per run |\n|---|---:|---|---|---:|---:|")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config:
        yaml.safe_dump({"scheduling": PREDICTED_TTFT_CONFIG}, config)
        config.flush()
        pair = ("picker", "picker-predicted-ttft")
        for load in (float(x) for x in args.loads.split(",")):
            for w in args.workloads.split(","):
                runs = [run_once(w, load, args.requests, r, args.time_scale, args.tabulate, pair, config.name,
                                 "pod-clock-") for r in range(args.repeats)]
                med = medians(runs, pair)
                per_run = [[run[pair[1]][m] / run[pair[0]][m] for run in runs] for m in METRICS]
                cells = [cell(med[p]) for p in pair]
                ratio = [med[pair[1]][m] / med[pair[0]][m] for m in METRICS]
                print(f"| {w} | {load:g} | {' | '.join(cells)} | {ratio[0]:.2f} / {ratio[1]:.2f} | "
                      f"{lowest_highest(per_run)} |", flush=True)


def peers(args: argparse.Namespace) -> None:
    """The defaults and predicted TTFT against sglang-router and vllm-router, run by run on the same fleet."""
    print(f"Live, 4 sim pods, {args.requests} requests, {args.repeats} run(s) per cell, time scale "
          f"{args.time_scale or 0.5}: TTFT mean and p90 ms, medians over the runs [lowest-highest run]; hit rate "
          "and the share of requests served cold (under half of the prompt from cache), medians; the oracle's cold "
          "share (requests no router could serve warm) below each workload\n")
    print("| workload | load | router | TTFT mean | TTFT p90 | hit rate | cold |\n|---|---:|---|---|---|---:|---:|")
    verdicts = []
    for load in (float(x) for x in args.loads.split(",")):
        for w in args.workloads.split(","):
            runs = [run_once(w, load, args.requests, r, args.time_scale, args.tabulate, PEER_ROUTERS, name="peers-")
                    for r in range(args.repeats)]
            routers = [p for p in PEER_ROUTERS if all(p in run for run in runs)]
            for p in routers:
                figures = {m: sorted(run[p][m] * 1e3 for run in runs) for m in METRICS}
                shown = [f"{statistics.median(v):.1f} [{v[0]:.1f}-{v[-1]:.1f}]" for v in figures.values()]
                hit, cold = (statistics.median(run[p][k] for run in runs) for k in ("hit_rate", "cold_share"))
                print(f"| {w} | {load:g} | {p} | {' | '.join(shown)} | {hit:.1%} | {cold:.1%} |", flush=True)
            oracle = statistics.median(run[routers[0]]["oracle_cold_share"] for run in runs)
            print(f"| {w} | {load:g} | oracle | | | | {oracle:.1%} |")
            for peer in (p for p in routers if p in PEERS):
                ours = [run["picker-predicted-ttft"]["ttft_p90"] for run in runs]
                theirs = [run[peer]["ttft_p90"] for run in runs]
                per_run = [a / b for a, b in zip(ours, theirs, strict=True)]
                verdicts.append(f"| {w} | {load:g} | {peer} | {statistics.median(ours) / statistics.median(theirs):.2f} "
                                f"| {min(per_run):.2f}-{max(per_run):.2f} | "
                                f"{'yes' if max(ours) < min(theirs) else 'no'} |")
    print("\nPredicted TTFT's p90 over each peer's: ratio of the medians, lowest and highest ratio of one run, and "
          "whether every run of predicted TTFT was below every run of the peer\n")
    print("| workload | load | peer | p90 ratio | per run | disjoint |\n|---|---:|---|---:|---:|---|")
    print("\n".join(verdicts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key in DEFAULT_CELLS:
        parser.add_argument(f"--{key}", type=int if key == "requests" else str,
                            help=f"default {DEFAULT_CELLS[key]}; --peers: {PEER_CELLS[key]}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=None, help="picker bench --live-time-scale (default 0.5)")
    parser.add_argument("--tabulate", action="store_true", help="print the table from the reports of an earlier run")
    parser.add_argument("--pod-clock", action="store_true", help="predicted TTFT at podTimeScale 1 against the pods'")
    parser.add_argument("--peers", action="store_true", help="the defaults and predicted TTFT against sglang-router "
                        "and vllm-router")
    args = parser.parse_args()
    chosen = vars(args)
    for key, default in (PEER_CELLS if args.peers else DEFAULT_CELLS).items():
        if chosen[key] is None:
            chosen[key] = default
    if args.peers:
        peers(args)
        return 0
    if args.pod_clock:
        pod_clock(args)
        return 0
    print(f"Live, 4 sim pods, {args.repeats} run(s) per cell, time scale {args.time_scale or 0.5}: TTFT mean / p90 ms "
          "(medians over the runs) for prefix-hash, the defaults and predicted TTFT; predicted TTFT's medians over "
          "the better of the other two; the spread of the runs of each picker, mean / p90 (max - min over median, "
          "the largest of the three pickers); the lowest and highest ratio of one run, mean / p90\n")
    print("| workload | load | prefix-hash | defaults | predicted TTFT | ratio | spread | ratio per run |\n"
          "|---|---:|---|---|---|---:|---:|---:|")
    for load in (float(x) for x in args.loads.split(",")):
        for w in args.workloads.split(","):
            runs = [run_once(w, load, args.requests, r, args.time_scale, args.tabulate) for r in range(args.repeats)]
            med = medians(runs, PICKERS)
            noise = [max(spread([run[p][m] for run in runs]) for p in PICKERS) for m in METRICS]
            cells = [cell(med[p]) for p in PICKERS]
            ratio = [med[PICKERS[2]][m] / min(med[p][m] for p in PICKERS[:2]) for m in METRICS]
            per_run = [[run[PICKERS[2]][m] / min(run[p][m] for p in PICKERS[:2]) for run in runs] for m in METRICS]
            print(f"| {w} | {load:g} | {' | '.join(cells)} | {ratio[0]:.2f} / {ratio[1]:.2f} | "
                  f"{noise[0]:.2f} / {noise[1]:.2f} | {lowest_highest(per_run)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
