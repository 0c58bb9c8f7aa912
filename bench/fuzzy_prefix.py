"""Does fuzzy prefix matching (`fuzzy-prefix-scorer`, MinHash-LSH over the prompt's leading window) pay? Fast mode,
same traces, the picker's defaults with and without it.

The shared-prefix workload three ways: as it is; with a line unique to each request (a request id and time) at the
start of its system prompt, so prompts of a group differ early and exact prefix matching finds nothing; and with
that line at the end of the system prompt, so they differ late and exact matching finds the shared part. The
fuzzy scorer (weight 2 in both default profiles) speaks only when the exact match is empty.

    .venv/bin/python bench/fuzzy_prefix.py [--requests 3000] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replicas import _commit, _trace, oracle_ttft_cells, run_parallel, write_report  # noqa: E402

from picker.scheduling.config import DEFAULT_CONFIG  # noqa: E402
from picker.scheduling.fuzzy import FuzzyPrefixScorer  # noqa: E402
from picker_lab.bench.configs import with_scorer  # noqa: E402
from picker_lab.bench.fast import FastConfig, run_fast  # noqa: E402
from picker_lab.bench.prompts import prompt_text  # noqa: E402
from picker_lab.bench.suite import FastSpec, calibrate  # noqa: E402
from picker_lab.bench.summary import summarize  # noqa: E402
from picker_lab.bench.trace import Trace  # noqa: E402

WORKLOAD = "shared-prefix"
VARIANTS = ("as generated", "differs early", "differs late")
SCHEDULERS = ("defaults", "defaults + fuzzy")


def variant(trace: Trace, how: str) -> Trace:
    """Each request's system prompt with a line of its own at its start or end."""
    if how == "as generated":
        return trace
    out = []
    for r in trace.requests:
        line = f"Request {r.index:06d} received at 12:{r.index // 60 % 60:02d}:{r.index % 60:02d}."
        messages = tuple((role, (f"{line}\n{text}" if how == "differs early" else f"{text}\n{line}")
                          if role == "system" else text) for role, text in r.messages)
        out.append(replace(r, messages=messages))
    return replace(trace, requests=tuple(out))


def run(spec: FastSpec, rate: float, how: str, scheduler: str) -> dict[str, Any]:
    scheduling = (with_scorer(DEFAULT_CONFIG, "fuzzy-prefix-scorer", 2) if scheduler == "defaults + fuzzy"
                  else spec.scheduling_config())
    res = run_fast(variant(_trace(spec, WORKLOAD, rate), how), "picker",
                   FastConfig(spec.get_profile(), spec.pods, seed=spec.seed), scheduling=scheduling)
    return {"figures": summarize(res), "wall_s": res.wall_s}


def signature_cost(spec: FastSpec, rate: float, count: int = 500) -> float:
    """Median seconds the scorer takes to sign one prompt of the trace (its cost per request)."""
    hasher = FuzzyPrefixScorer().hasher
    trace = variant(_trace(spec, WORKLOAD, rate), "differs early")
    took = []
    for r in trace.requests[:count]:
        text = prompt_text(r.messages, r.prompt)
        began = time.perf_counter()
        hasher.band_keys(text)
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| prompts | scheduler | hit rate | oracle | TTFT mean | TTFT p90 | p90 vs defaults |",
             "|---|---|---:|---:|---:|---:|---:|"]
    base = {r["variant"]: r["figures"] for r in rows if r["scheduler"] == "defaults"}
    for r in rows:
        f, b = r["figures"], base[r["variant"]]
        lines.append(f"| {r['variant']} | {r['scheduler']} | {f['hit_rate'] * 100:.1f} % | {oracle_ttft_cells(f, b)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--out", default="bench/out/fuzzy-prefix")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.monotonic()
    spec = FastSpec(workloads=(WORKLOAD,), requests=args.requests, sweep_workloads=(), capacity_workload=None)
    rate = calibrate(spec)[WORKLOAD]["rate_rps"]
    jobs = [(v, s) for v in VARIANTS for s in SCHEDULERS]
    outs = run_parallel(run, [(spec, rate, v, s) for v, s in jobs], args.jobs)
    rows = [{"variant": v, "scheduler": s, "rate_rps": rate, **out} for (v, s), out in zip(jobs, outs, strict=True)]
    cost = signature_cost(spec, rate)
    header = (f"Fast mode, {spec.pods} pods, {spec.profile}, load 0.8, {args.requests} {WORKLOAD} requests, seed "
              f"{spec.seed}, commit {_commit()}. A prompt's signature: {cost * 1e3:.2f} ms (median of 500). "
              f"`bench/fuzzy_prefix.py` took {time.monotonic() - started:.0f} s.\n\n")
    write_report(args.out, "fuzzy_prefix", header, markdown(rows), {"rows": rows, "signature_s": cost})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
