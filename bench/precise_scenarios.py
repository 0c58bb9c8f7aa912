"""Where the approximate prefix index is wrong, and what the pods' KV events buy (fast mode, same traces).

The approximate index learns from the picker's own picks. It is right when the picker sees every request and the
pods' caches are as large as they say; these scenarios break that, each replayed with the approximate index, with
the precise view fed by the pods' KV events (`--kv-events-endpoint`, `--prefix-mode auto`; events applied at the
end of the engine step that raised them, every replica following every pod), and with the exact cache view (the
bound: the pods' real caches read at each decision):

  - sees everything: the baseline (precise must be no worse);
  - 30 % bypass: that share of requests reaches a random pod around the picker (another gateway, batch jobs);
  - two pickers, own indexes: two replicas behind Envoy, no shared index;
  - a pod restarts every 5 s (one after the other, its cache emptied, too fast for a failed scrape to tell the
    picker), and every 60 s over a trace long enough for 5 restarts (~5 minutes: more requests than the others);
  - KV reported 2x / 0.5x: the pods' `num_gpu_blocks` says twice / half the cache they have (offload tiers,
    other tenants), which sizes the approximate index's per-pod LRU.

    .venv/bin/python bench/precise_scenarios.py [--requests 3000] [--blocks 6500] [--jobs 2] [--out DIR]
    make precise-scenarios
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replicas import _commit, _trace, oracle_ttft_cells, run_parallel, write_report  # noqa: E402

from picker_lab.bench.fast import FastConfig, run_fast  # noqa: E402
from picker_lab.bench.suite import FastSpec, calibrate  # noqa: E402
from picker_lab.bench.summary import summarize  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn")


@dataclass(frozen=True)
class Scenario:
    name: str
    replicas: int = 1
    bypass: float = 0.0
    kv_reported: float = 1.0
    restart_every: float = 0.0
    min_seconds: float = 0.0  # the trace lasts at least this long (more requests at the same rate)


SCENARIOS = (
    Scenario("sees everything"),
    Scenario("30 % bypass", bypass=0.3),
    Scenario("two pickers, own indexes", replicas=2),
    Scenario("a pod restarts every 5 s", restart_every=5.0),
    Scenario("a pod restarts every 60 s", restart_every=60.0, min_seconds=300.0),
    Scenario("KV reported 2x", kv_reported=2.0),
    Scenario("KV reported 0.5x", kv_reported=0.5),
)
MODES = ("approximate", "precise", "exact")


def run(spec: FastSpec, workload: str, rate: float, scenario: Scenario, mode: str) -> dict[str, Any]:
    cfg = FastConfig(spec.get_profile(), spec.pods, seed=spec.seed, replicas=scenario.replicas,
                     bypass=scenario.bypass, kv_reported=scenario.kv_reported,
                     restart_every=scenario.restart_every, precise=mode == "precise",
                     exact_index=mode == "exact")
    if scenario.min_seconds:
        spec = replace(spec, requests=max(spec.requests, math.ceil(rate * scenario.min_seconds)))
    res = run_fast(_trace(spec, workload, rate), "picker", cfg, scheduling=spec.scheduling_config())
    figures = summarize(res)
    around = set(res.bypassed)  # the hit rate of the requests the picker routed, bypassed ones left out
    routed = [i for i in range(res.n) if i not in around]
    prompt = sum(res.prompt_tokens[i] for i in routed)
    figures["routed_hit_rate"] = sum(res.cached_tokens[i] for i in routed) / prompt if prompt else float("nan")
    return {"figures": figures, "wall_s": res.wall_s, "notes": res.notes}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | scenario | index | hit rate (the picker's requests) | oracle | TTFT mean | TTFT p90 | "
             "p90 vs approximate |", "|---|---|---|---:|---:|---:|---:|---:|"]
    base = {(r["workload"], r["scenario"]): r["figures"] for r in rows if r["mode"] == "approximate"}
    for r in rows:
        f, b = r["figures"], base[(r["workload"], r["scenario"])]
        lines.append(f"| {r['workload']} | {r['scenario']} | {r['mode']} | {f['hit_rate'] * 100:.1f} % "
                     f"({f['routed_hit_rate'] * 100:.1f} %) | {oracle_ttft_cells(f, b)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=6500, help="KV blocks per pod (cache pressure)")
    parser.add_argument("--out", default="bench/out/precise-scenarios")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.monotonic()
    spec = FastSpec(workloads=WORKLOADS, requests=args.requests, sweep_workloads=(), capacity_workload=None,
                    profile_overrides=(("num_gpu_blocks", args.blocks),))
    cal = calibrate(spec)
    jobs = [(w, s, m) for w in WORKLOADS for s in SCENARIOS for m in MODES]
    outs = run_parallel(run, [(spec, w, cal[w]["rate_rps"], s, m) for w, s, m in jobs], args.jobs)
    rows = [{"workload": w, "scenario": s.name, "mode": m, "rate_rps": cal[w]["rate_rps"], **out}
            for (w, s, m), out in zip(jobs, outs, strict=True)]
    header = (f"Fast mode, {spec.pods} pods, llama3-8b-h100 with {args.blocks:,} KV blocks per pod, load 0.8, "
              f"{args.requests} requests (more where a scenario needs a longer trace), seed {spec.seed}, "
              f"commit {_commit()}; hit rate of prompt tokens, oracle = "
              f"an infinite cache's. `bench/precise_scenarios.py` took {time.monotonic() - started:.0f} s.\n\n")
    write_report(args.out, "precise_scenarios", header, markdown(rows), {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
