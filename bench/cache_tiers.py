"""Routing by cache tier against counting every tier the same (fast mode, same traces, several seeds).

The pods offload KV blocks to host memory (vLLM's OffloadingConnector, CPU tier: the simulator's
`num_cpu_blocks`, every prompt block written through, loading one back costing `host_load_cost` of computing it)
and their KV events say which medium holds each block. The workloads' prefixes fill `--kv-fill` times the fleet's
device memory, so much of what is cached is only in host memory. The picker follows the events (precise mode) and
weighs a block held only by host memory by `mediumWeights.CPU`:

  - no host tier: the same pods without offloading (what the tier buys);
  - device only: weight 0 (a router that reads only the device's events);
  - tiers equal: weight 1 (every stored block alike: the picker before tiers, and routers without them);
  - by tier (w): weight w (0.8 is the default).

    .venv/bin/python bench/cache_tiers.py [--seeds 1,2,3] [--requests 3000] [--blocks 1500] [--cpu-blocks 6000]
    make cache-tiers
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replicas import _commit, _trace, run_parallel, write_report  # noqa: E402

from picker.prefix.precise import DEFAULT_MEDIUM_WEIGHTS  # noqa: E402
from picker.scheduling.config import scheduling_config  # noqa: E402
from picker_lab.bench.fast import FastConfig, run_fast  # noqa: E402
from picker_lab.bench.suite import FastSpec, calibrate  # noqa: E402
from picker_lab.bench.summary import summarize  # noqa: E402

WORKLOADS = ("zipf-prefix", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class Mode:
    name: str
    cpu_weight: float | None  # None: the pods have no host tier
    default: bool = False


MODES = (
    Mode("no host tier", None),
    Mode("device only", 0.0),
    Mode("by tier (0.5)", 0.5),
    Mode("by tier (0.8)", DEFAULT_MEDIUM_WEIGHTS["CPU"], default=True),
    Mode("by tier (0.9)", 0.9),
    Mode("tiers equal", 1.0),
)
EQUAL = "tiers equal"


def scheduling(cpu_weight: float) -> str:
    """The picker's default scheduling config with the precise producer's CPU weight set."""
    config = scheduling_config(None).model_dump(by_alias=True)
    config["plugins"].append({"type": "precise-prefix-cache-producer",
                              "parameters": {"mediumWeights": {"CPU": cpu_weight}}})
    return json.dumps(config)


def run(spec: FastSpec, workload: str, rate: float, mode: Mode, cpu_blocks: int) -> dict[str, Any]:
    tiered = mode.cpu_weight is not None
    spec = replace(spec, profile_overrides=(*spec.profile_overrides, ("num_cpu_blocks", cpu_blocks if tiered else 0)),
                   scheduling=scheduling(mode.cpu_weight if mode.cpu_weight is not None else 1.0))
    cfg = FastConfig(spec.get_profile(), spec.pods, seed=spec.seed, precise=True)
    res = run_fast(_trace(spec, workload, rate), "picker", cfg, scheduling=spec.scheduling_config())
    return {"figures": summarize(res), "wall_s": res.wall_s}


def markdown(rows: list[dict[str, Any]], seeds: list[int]) -> str:
    """Per workload and mode: medians over the seeds (range in brackets) and TTFT p90 against tiers-equal's of the
    same seed."""
    lines = ["| workload | routing | hit rate (device + host) | TTFT mean ms | TTFT p90 ms | p90 / tiers equal "
             "(per seed) |", "|---|---|---:|---:|---:|---:|"]
    cell = {(r["workload"], r["mode"], r["seed"]): r["figures"] for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for mode in MODES:
            figs = [cell[(workload, mode.name, s)] for s in seeds]
            ratios = [f["ttft_p90"] / cell[(workload, EQUAL, s)]["ttft_p90"] for f, s in zip(figs, seeds, strict=True)]
            name = f"**{mode.name}**" if mode.default else mode.name
            lines.append(f"| {workload} | {name} | {_median((f['hit_rate'] for f in figs), 3)} | "
                         f"{_median((f['ttft_mean'] * 1000 for f in figs), 0)} | "
                         f"{_median((f['ttft_p90'] * 1000 for f in figs), 0)} | "
                         f"{_median(ratios, 3)}x ({', '.join(f'{r:.3f}' for r in ratios)}) |")
    return "\n".join(lines) + "\n"


def _median(values: Any, digits: int) -> str:
    v = sorted(values)
    return f"{statistics.median(v):.{digits}f} [{v[0]:.{digits}f}-{v[-1]:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=1500, help="device KV blocks per pod")
    parser.add_argument("--cpu-blocks", type=int, default=6000, help="host-memory KV blocks per pod")
    parser.add_argument("--load-cost", type=float, default=None,
                        help="loading a token from host memory, as a fraction of computing it (default: the profile's)")
    parser.add_argument("--kv-fill", type=float, default=2.0, help="the prefixes' tokens over the fleet's device KV")
    parser.add_argument("--out", default="bench/out/cache-tiers")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.monotonic()
    seeds = [int(s) for s in args.seeds.split(",")]
    params = {w: {"kv_fill": args.kv_fill} for w in WORKLOADS if w != "multi-turn"}
    base = FastSpec(workloads=WORKLOADS, requests=args.requests, sweep_workloads=(), capacity_workload=None,
                    profile_overrides=(("num_gpu_blocks", args.blocks), ("host_load_cost", args.load_cost)),
                    workload_params=json.dumps(params))
    cal = calibrate(base)
    jobs = [(w, m, s) for s in seeds for w in WORKLOADS for m in MODES]
    outs = run_parallel(run, [(replace(base, seed=s), w, cal[w]["rate_rps"], m, args.cpu_blocks)
                              for w, m, s in jobs], args.jobs)
    rows = [{"workload": w, "mode": m.name, "cpu_weight": m.cpu_weight, "seed": s, "rate_rps": cal[w]["rate_rps"],
             **out} for (w, m, s), out in zip(jobs, outs, strict=True)]
    header = (f"Fast mode, {base.pods} pods, llama3-8b-h100 with {args.blocks:,} device KV blocks and "
              f"{args.cpu_blocks:,} host-memory blocks per pod (loading a token from host memory "
              f"{base.get_profile().host_load_cost} of computing it), prefixes filling {args.kv_fill}x the fleet's device KV (zipf-prefix, shared-prefix), load 0.8, "
              f"{args.requests} requests, seeds {args.seeds}, precise mode (the pods' KV events), commit "
              f"{_commit()}; medians over the seeds [range]. `bench/cache_tiers.py` took "
              f"{time.monotonic() - started:.0f} s.\n\n")
    write_report(args.out, "cache_tiers", header, markdown(rows, seeds), {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
