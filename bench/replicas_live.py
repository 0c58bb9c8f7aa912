"""The replicas result with real processes: picker replicas behind one real Envoy, on a live simulated fleet.

`bench/replicas.py` models replicas in fast mode with zero replication lag. This replays the live benchmark's trace
(`picker bench --mode live`: shared-prefix on `picker sim` pods over real HTTP and gRPC) through:
Envoy round-robin (no picker), one picker, and two picker replicas that one Envoy balances ext_proc streams over
(each on its own loopback address, same ports, as pods behind a Service), with their own prefix indexes or the
index shared through a local Valkey (`--index-backend redis`, real replication lag).

    .venv/bin/python bench/replicas_live.py [--requests 300] [--pods 4] [--out bench/out/replicas-live]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from picker.bench.capacity import cost_per_request, rate_for_load  # noqa: E402
from picker.bench.live import LiveSpec, _measure, _wait_pods_ready, start_router  # noqa: E402
from picker.bench.progress import ProgressBar  # noqa: E402
from picker.bench.results import RunResult  # noqa: E402
from picker.bench.summary import summarize  # noqa: E402
from picker.bench.workloads import FleetSpec, generate  # noqa: E402
from picker.serving.supervisor import (  # noqa: E402
    Managed,
    free_port,
    process_scope,
    start_envoy,
    start_picker,
    start_sim,
    start_valkey,
)

ROUTINGS = ("round-robin (Envoy, no picker)", "picker, 1 replica", "picker, 2 replicas, own index",
            "picker, 2 replicas, shared index")


def start_replicas(logdir: Path, pool: list[str], shared: bool, name: str) -> tuple[list[Managed], str]:
    procs: list[Managed] = []
    extra = ["--log-level", "WARNING"]
    if shared:
        valkey = start_valkey(logdir, name=f"valkey-{name}")
        procs.append(valkey.process)
        extra += ["--index-backend", "redis", "--redis-url", valkey.url, "--index-namespace", name]
    grpc_port, health_port = free_port(), free_port()
    pickers = []
    for i in range(2):
        picker = start_picker(logdir, endpoints=pool, extra=extra, name=f"{name}-{i}", host=f"127.0.0.{5 + i}",
                              grpc_port=grpc_port, health_port=health_port)
        procs.append(picker.process)
        pickers.append(picker)
    envoy = start_envoy(logdir, pickers, pool, name=f"envoy-{name}")
    procs.append(envoy.process)
    return procs, envoy.url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "replicas-live"))
    args = parser.parse_args()
    spec = LiveSpec(pods=args.pods, requests=args.requests, load=args.load)
    profile = spec.get_profile()
    fleet = FleetSpec(profile, spec.pods)
    rate = rate_for_load(spec.load, spec.pods, cost_per_request(spec.workload, fleet, spec.seed, spec.params))
    trace = generate(spec.workload, spec.requests, rate, spec.seed, fleet, **spec.params)
    results: dict[str, RunResult] = {}
    bar = ProgressBar(len(trace) * len(ROUTINGS), "replicas live")
    try:
        with process_scope("bench-replicas-live") as (logdir, started):
            extra = ["--profile", profile.name, "--seed", str(spec.seed), "--num-gpu-blocks",
                     str(spec.num_gpu_blocks)]
            sim = start_sim(spec.pods, logdir, time_scale=spec.time_scale, extra=extra)
            started.append(sim.process)
            urls = [f"http://{a}" for a in sim.addresses]
            _wait_pods_ready(urls)
            for label in ROUTINGS:
                bar.set_label(f"replicas live: {label}")
                if label.startswith("round-robin"):
                    procs, url = start_router("round-robin", spec, sim.addresses, urls, logdir)
                elif "1 replica" in label:
                    procs, url = start_router("picker", spec, sim.addresses, urls, logdir)
                else:
                    procs, url = start_replicas(logdir, sim.addresses, "shared" in label,
                                                "shared" if "shared" in label else "own")
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
    base = figures[ROUTINGS[0]]
    lines = [f"Live: {spec.workload}, {spec.pods} simulated pods (`{profile.name}`, {spec.num_gpu_blocks} KV blocks "
             f"each, time scale {spec.time_scale}), {spec.requests} requests at load {spec.load}, seed {spec.seed}.",
             "", "| routing | hit rate | TTFT mean | TTFT p95 | mean / p95 vs round-robin | failed |",
             "|---|---|---|---|---|---|"]
    for label, f in figures.items():
        lines.append(f"| {label} | {f['hit_rate'] * 100:.1f}% | {f['ttft_mean'] * 1e3:.1f} ms | "
                     f"{f['ttft_p95'] * 1e3:.1f} ms | {f['ttft_mean'] / base['ttft_mean']:.2f} / "
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
