"""The replicas result with real processes: picker replicas behind one real Envoy, on a live simulated fleet.

`bench/replicas.py` models replicas in fast mode with zero replication lag. This replays a live benchmark trace
(`picker bench --mode live`: `--workload`, default shared-prefix, on `picker sim` pods over real HTTP and gRPC)
through: Envoy round-robin (no picker), one picker, and `--replicas` picker replicas (default 2) that one Envoy
balances ext_proc streams over (each on its own loopback address, same ports, as pods behind a Service): with their
own prefix indexes, with the index shared through a local Valkey (`--index-backend redis`, real replication lag)
but each counting only its own requests (`--shared-load-interval 0`), and sharing their in-flight counts too (the
default with a shared index).

    .venv/bin/python bench/replicas_live.py [--requests 300] [--pods 4] [--replicas 2] [--workload imbalance]
        [--out bench/out/replicas-live]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from picker_lab.bench.capacity import cost_per_request, rate_for_load  # noqa: E402
from picker_lab.bench.live import LiveSpec, _measure, _wait_pods_ready, start_router  # noqa: E402
from picker_lab.bench.progress import ProgressBar  # noqa: E402
from picker_lab.bench.results import RunResult  # noqa: E402
from picker_lab.bench.summary import summarize  # noqa: E402
from picker_lab.bench.workloads import FleetSpec, generate  # noqa: E402
from picker_lab.supervisor import (  # noqa: E402
    Managed,
    process_scope,
    start_picker_fleet,
    start_sim,
    start_valkey,
)

# What the replicas share through Valkey, per row: nothing, the prefix index (and scrapes), or that and their load
SHARING = {"own index": None, "shared index, own counts": "0", "shared index and load": "50ms"}


def routings(replicas: int) -> tuple[str, ...]:
    return ("round-robin (Envoy, no picker)", "picker, 1 replica",
            *(f"picker, {replicas} replicas, {sharing}" for sharing in SHARING))


def start_replicas(logdir: Path, pool: list[str], n: int, sharing: str, k: int) -> tuple[list[Managed], str]:
    """`n` replicas behind one Envoy, sharing what `sharing` (a key of SHARING) says through a fresh Valkey."""
    procs: list[Managed] = []
    extra = ["--log-level", "WARNING"]
    load_interval = SHARING[sharing]
    if load_interval is not None:
        valkey = start_valkey(logdir, name=f"valkey-{k}")
        procs.append(valkey.process)
        extra += ["--index-backend", "redis", "--redis-url", valkey.url, "--index-namespace", f"replicas-{k}",
                  "--shared-load-interval", load_interval]
    fleet = start_picker_fleet(logdir, pool, flags=extra, replicas=n, name=f"replicas-{k}", first_host=10 + 10 * k)
    return procs + fleet.processes, fleet.envoy.url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--replicas", type=int, default=2, help="picker replicas in the multi-replica rows (default 2)")
    parser.add_argument("--workload", default="shared-prefix", help="the live trace's workload (default shared-prefix)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "replicas-live"))
    args = parser.parse_args()
    spec = LiveSpec(workload=args.workload, pods=args.pods, requests=args.requests, load=args.load)
    rows = routings(args.replicas)
    profile = spec.get_profile()
    fleet = FleetSpec(profile, spec.pods)
    rate = rate_for_load(spec.load, spec.pods, cost_per_request(spec.workload, fleet, spec.seed, spec.params))
    trace = generate(spec.workload, spec.requests, rate, spec.seed, fleet, **spec.params)
    results: dict[str, RunResult] = {}
    bar = ProgressBar(len(trace) * len(rows), "replicas live")
    try:
        with process_scope("bench-replicas-live") as (logdir, started):
            extra = ["--profile", profile.name, "--seed", str(spec.seed), "--num-gpu-blocks",
                     str(spec.num_gpu_blocks)]
            sim = start_sim(spec.pods, logdir, time_scale=spec.time_scale, extra=extra)
            started.append(sim.process)
            urls = [f"http://{a}" for a in sim.addresses]
            _wait_pods_ready(urls)
            for k, label in enumerate(rows):
                bar.set_label(f"replicas live: {label}")
                if label.startswith("round-robin"):
                    router = start_router("round-robin", spec, sim.addresses, urls, logdir)
                    procs, url = router.processes, router.url
                elif "1 replica" in label:
                    router = start_router("picker", spec, sim.addresses, urls, logdir)
                    procs, url = router.processes, router.url
                else:
                    procs, url = start_replicas(logdir, sim.addresses, args.replicas, label.split(", ", 2)[2], k)
                started.extend(procs)
                strategy = "round-robin" if label.startswith("round-robin") else "picker"
                try:
                    results[label] = asyncio.run(_measure(strategy, url, spec, trace, urls, profile.model, bar))
                finally:
                    for p in reversed(procs):
                        p.stop()
                        started.remove(p)
    finally:
        bar.close()
    figures = {label: summarize(res) for label, res in results.items()}
    base = figures[rows[0]]
    lines = [f"Live: {spec.workload}, {spec.pods} simulated pods (`{profile.name}`, {spec.num_gpu_blocks} KV blocks "
             f"each, time scale {spec.time_scale}), {spec.requests} requests at load {spec.load}, seed {spec.seed}.",
             "", "| routing | hit rate | TTFT mean | TTFT p90 | TTFT p95 | mean / p95 vs round-robin | failed |",
             "|---|---|---|---|---|---|---|"]
    for label, f in figures.items():
        lines.append(f"| {label} | {f['hit_rate'] * 100:.1f}% | {f['ttft_mean'] * 1e3:.1f} ms | "
                     f"{f['ttft_p90'] * 1e3:.1f} ms | {f['ttft_p95'] * 1e3:.1f} ms | "
                     f"{f['ttft_mean'] / base['ttft_mean']:.2f} / "
                     f"{f['ttft_p95'] / base['ttft_p95']:.2f} | {f.get('failed', 0)} |")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas-live.md").write_text(text + "\n")
    (out / "replicas-live.json").write_text(json.dumps({"spec": {**spec.__dict__}, "figures": figures},
                                                       indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
