"""How far is the picker's approximate prefix index from exact knowledge of every pod's KV cache? (fast mode)

The approximate index learns from its own picks (character blocks, per-pod LRU sized from `num_gpu_blocks`).
Precise routing (vLLM KV events) would know each pod's cached token blocks. This bounds what precise routing can
buy: the same scheduler, its prefix matches read from the simulated pods' real caches at the moment of each
decision (exact tokens, evictions seen at once, zero event lag), side by side with the approximate index and
round-robin, at the headline's cache size and under cache pressure (smaller KV caches per pod).

    .venv/bin/python bench/exact_index.py [--requests 4000] [--blocks 26000,6500,3250] [--out DIR] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replicas import WORKLOADS, Variant, _commit, _trace, markdown, run_parallel, write_report  # noqa: E402

from picker_lab.bench.fast import FastConfig, run_fast  # noqa: E402
from picker_lab.bench.suite import FastSpec, calibrate  # noqa: E402
from picker_lab.bench.summary import summarize  # noqa: E402

VARIANTS = (
    Variant("round-robin (Envoy, no picker)", "round-robin"),
    Variant("picker, approximate index", "picker"),
    Variant("picker, exact cache view (bound of KV-event routing)", "picker", exact_index=True),
)


def run(trace_spec: FastSpec, fleet_spec: FastSpec, workload: str, rate: float, variant: Variant) -> dict[str, Any]:
    """The trace sized for `trace_spec`'s fleet, replayed on `fleet_spec`'s (smaller caches: more pressure)."""
    cfg = FastConfig(fleet_spec.get_profile(), fleet_spec.pods, seed=fleet_spec.seed, exact_index=variant.exact_index)
    res = run_fast(_trace(trace_spec, workload, rate), variant.strategy, cfg,
                   scheduling=fleet_spec.scheduling_config())
    return {"figures": summarize(res), "wall_s": res.wall_s, "notes": res.notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--blocks", default="26000,6500,3250", help="KV blocks per pod to compare")
    parser.add_argument("--out", default="bench/out/exact-index")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.monotonic()
    specs = {int(b): FastSpec(workloads=WORKLOADS, requests=args.requests, sweep_workloads=(), capacity_workload=None,
                              profile_overrides=(("num_gpu_blocks", int(b)),))
             for b in args.blocks.split(",") if b.strip()}
    # One trace and offered rate per workload (sized and calibrated for the largest cache: the workload
    # generators size prefixes to the fleet's cache), so only the cache changes between rows of a workload.
    base = specs[max(specs)]
    cal = calibrate(base)
    jobs = [(blocks, w, v) for blocks in specs for w in WORKLOADS for v in VARIANTS]
    outs = run_parallel(run, [(base, specs[b], w, cal[w]["rate_rps"], v) for b, w, v in jobs], args.jobs)
    rows = [{"workload": f"{w}, {b:,} blocks/pod", "label": v.label, "strategy": v.strategy, "replicas": v.replicas,
             "exact_index": v.exact_index, "rate_rps": cal[w]["rate_rps"], **out}
            for (b, w, v), out in zip(jobs, outs, strict=True)]
    table = markdown(rows)
    header = (f"Fast mode, 8 pods, llama3-8b-h100 with the KV cache per pod as given, rate of load 0.8 at "
              f"{max(specs):,} blocks, {args.requests} requests, seed 1, commit {_commit()}. "
              f"`bench/exact_index.py` took {time.monotonic() - started:.0f} s.\n\n")
    write_report(args.out, "exact_index", header, table, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
