"""What a shared prefix index buys when several picker replicas sit behind one Envoy (fast mode).

    .venv/bin/python bench/replicas.py [--requests 4000] [--out DIR] [--jobs 2]

Envoy round-robins ext_proc streams over the picker replicas, so consecutive requests of one prefix reach different
replicas. With their own prefix index each replica only knows where *it* sent a prefix; with the shared index
(`picker serve --index-backend redis`) every replica sees every pick. Fast mode models the shared index as one
in-process index updated at the pick, i.e. with zero replication lag (the real one converges within milliseconds).

Same seeded traces and calibration as `picker bench --mode fast` (8 pods, profile llama3-8b-h100, load 0.8,
seed 1); rows: Envoy round-robin (no picker), the picker with 1 replica, 2 and 4 replicas with own or shared index,
and 4 replicas also sharing their in-flight counts every 50 ms (`--shared-load-interval`, the default with a
shared index; the other rows count only their own requests, as before it).
Writes DIR/replicas.md and DIR/replicas.json (default DIR: bench/out/replicas).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from picker.core.distribution import git_commit
from picker_lab.bench.fast import FastConfig, run_fast  # noqa: E402
from picker_lab.bench.suite import FastSpec, calibrate  # noqa: E402
from picker_lab.bench.summary import summarize  # noqa: E402
from picker_lab.bench.trace import Trace  # noqa: E402
from picker_lab.bench.workloads import FleetSpec, generate  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn", "imbalance")


@dataclass(frozen=True)
class Variant:
    label: str
    strategy: str
    replicas: int = 1
    shared_index: bool = False
    peer_picks: bool = True
    exact_index: bool = False  # bench/exact_index.py: matches from the pods' real caches
    load_sync_interval: float = 0.0  # replicas share their in-flight counts this often (picker serve: 50 ms)


VARIANTS = (
    Variant("round-robin (Envoy, no picker)", "round-robin"),
    Variant("picker, 1 replica", "picker"),
    Variant("picker, 2 replicas, own index", "picker", 2),
    Variant("picker, 2 replicas, shared index", "picker", 2, True),
    Variant("picker, 4 replicas, own index", "picker", 4),
    Variant("picker, 4 replicas, shared index, no peer picks", "picker", 4, True, False),
    Variant("picker, 4 replicas, shared index", "picker", 4, True),
    Variant("picker, 4 replicas, shared index and load", "picker", 4, True, load_sync_interval=0.05),
)


@functools.lru_cache(maxsize=4)
def _trace(spec: FastSpec, workload: str, rate: float) -> Trace:
    """The suite's trace for this workload (suite._trace: same generator, parameters and seed)."""
    params = {"arrival": spec.arrival, **spec.params(workload)}
    return generate(workload, spec.requests, rate, spec.seed, FleetSpec(spec.get_profile(), spec.pods), **params)


def run_variant(spec: FastSpec, workload: str, rate: float, variant: Variant) -> dict[str, Any]:
    """One replay; its figures plus how long it took."""
    cfg = FastConfig(spec.get_profile(), spec.pods, seed=spec.seed, replicas=variant.replicas,
                     shared_index=variant.shared_index, peer_picks=variant.peer_picks,
                     exact_index=variant.exact_index, load_sync_interval=variant.load_sync_interval)
    res = run_fast(_trace(spec, workload, rate), variant.strategy, cfg, scheduling=spec.scheduling_config())
    return {"figures": summarize(res), "wall_s": res.wall_s, "notes": res.notes}


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


def oracle_ttft_cells(f: dict[str, Any], base: dict[str, Any]) -> str:
    """The oracle's hit rate, TTFT mean, p90 and p90 against `base`: the columns the index benches end a row with."""
    return (f"{f['oracle_hit_rate'] * 100:.1f} % | {_ms(f['ttft_mean'])} | {_ms(f['ttft_p90'])} | "
            f"{_ratio(f['ttft_p90'], base['ttft_p90'])} |")


def _ratio(value: float, base: float) -> str:
    return "n/a" if not base or math.isnan(value) or math.isnan(base) else f"{value / base:.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | routing | hit rate (of oracle) | TTFT mean | TTFT p90 | TTFT p95 | mean / p95 vs round-robin | "
             "completed |", "|---|---|---|---|---|---|---|---|"]
    base = {r["workload"]: r for r in rows if r["strategy"] == "round-robin" and r["replicas"] == 1}
    for r in rows:
        f, b = r["figures"], base[r["workload"]]["figures"]
        lines.append(
            f"| {r['workload']} | {r['label']} | {f['hit_rate'] * 100:.1f}% ({f['hit_rate_of_oracle'] * 100:.0f}%) "
            f"| {_ms(f['ttft_mean'])} | {_ms(f['ttft_p90'])} | {_ms(f['ttft_p95'])} "
            f"| {_ratio(f['ttft_mean'], b['ttft_mean'])} / {_ratio(f['ttft_p95'], b['ttft_p95'])} "
            f"| {f['completed']} / {f['requests']} |")
    return "\n".join(lines) + "\n"


def run_parallel(fn: Callable[..., dict[str, Any]], calls: list[tuple[Any, ...]], jobs: int) -> list[dict[str, Any]]:
    """`fn(*call)` for every call on `jobs` forked workers, results in call order."""
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(fn, *call) for call in calls]
        return [f.result() for f in futures]


def write_report(out: str, stem: str, header: str, table: str, data: dict[str, Any]) -> None:
    """Print the table and write it (`stem`.md) with every figure (`stem`.json) to `out`."""
    print(header + table, end="")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(header + table)
    (out_dir / f"{stem}.json").write_text(json.dumps({"commit": _commit(), **data}, indent=1, default=str) + "\n")


def _commit() -> str:
    return git_commit(Path(__file__).resolve().parent) or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000, help="requests per workload (default 4000)")
    parser.add_argument("--out", default="bench/out/replicas", help="directory for replicas.md and replicas.json")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    spec = FastSpec(workloads=WORKLOADS, requests=args.requests, sweep_workloads=(), capacity_workload=None)
    cal = calibrate(spec)
    jobs = [(w, v) for w in WORKLOADS for v in VARIANTS]
    outs = run_parallel(run_variant, [(spec, w, cal[w]["rate_rps"], v) for w, v in jobs], args.jobs)
    rows = [{"workload": w, "label": v.label, "strategy": v.strategy, "replicas": v.replicas,
             "shared_index": v.shared_index, "rate_rps": cal[w]["rate_rps"], **out}
            for (w, v), out in zip(jobs, outs, strict=True)]
    table = markdown(rows)
    wall = time.monotonic() - started
    header = (f"Fast mode, {spec.pods} pods, profile {spec.profile}, load {spec.load}, {spec.requests} requests per "
              f"workload, seed {spec.seed}, commit {_commit()}; shared index = one index for every replica with zero "
              f"replication lag. `bench/replicas.py --requests {spec.requests}` took {wall:.0f} s.\n\n")
    write_report(args.out, "replicas", header, table, {
        "pods": spec.pods, "profile": spec.profile, "load": spec.load, "requests": spec.requests, "seed": spec.seed,
        "calibration": {w: cal[w] for w in WORKLOADS}, "wall_s": wall, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
