"""What the picker costs: Envoy direct (round-robin, no ext_proc) vs Envoy + picker in both body modes, with the
Redis-shared prefix index (a local Valkey) and behind an Envoy that does not let it turn the response headers off
(the third message per request it saves), and Envoy + the floor (a minimal grpc.aio ext_proc server that only sets
the destination header, `lab/picker_lab/bench/floor.py`; and the same on grpclib), same echo backends, same run. Reports
req/s, p50/p99 latency and picker CPU µs per request for 1 KB and 32 KB bodies, then the CPU per request of direct
Envoy, the picker and the floors (with their Envoys) open-loop at `--rate`, the idle picker's and floors' CPU, and
profiles the picker to show where its time goes.

    .venv/bin/python bench/overhead.py [--requests 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from picker.serving.envoyconfig import envoy_binary
from picker_lab.bench import floor as floor_server
from picker_lab.bench.summary import nearest_rank
from picker_lab.supervisor import (
    Envoy,
    Managed,
    cpu_seconds,
    free_port,
    port_open,
    process_scope,
    spawn,
    start_backends,
    start_envoy,
    start_picker,
    start_valkey,
    wait_until,
)

OUT = Path(__file__).resolve().parent / "out"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
KEPT = "envoy+picker buffered, response headers sent"
FLOOR = "envoy+floor buffered (minimal grpc.aio ext_proc)"
FLOOR_GRPCLIB = "envoy+floor buffered, grpclib (the same on grpclib)"


def start_variant_envoy(logdir: Path, template: Envoy, started: list[Managed], name: str,
                        change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> Envoy:
    """`template`'s Envoy config on ports of its own, its HTTP filters as `change` returns them."""
    config = yaml.safe_load(template.config_path.read_text())
    listener = config["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = change(hcm["http_filters"])
    port, admin_port = free_port(), free_port()
    listener["address"]["socket_address"]["port_value"] = port
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    path = logdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = spawn(name, [envoy_binary(), "-c", str(path), "--base-id", str(os.getpid() % 50000 + 7 + len(started)),
                           "-l", "warning", "--concurrency", "1"], logdir)
    started.append(process)
    wait_until(lambda: port_open(port), 30, name, process.proc)
    return Envoy(port, admin_port, process, path, template.settings)


def start_direct_envoy(logdir: Path, template: Envoy, started: list[Managed]) -> tuple[str, Managed]:
    """The same Envoy config with the ext_proc filter removed: every request round-robins over the pool."""
    envoy = start_variant_envoy(logdir, template, started, "envoy-direct",
                                lambda filters: [f for f in filters if f["name"] != EXT_PROC_FILTER])
    return envoy.url, envoy.process


def headers_kept(filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ext_proc filter without `allow_mode_override`: Envoy sends the picker every response's headers, as
    before the picker turned them off (three messages per request instead of two)."""
    for f in filters:
        if f["name"] == EXT_PROC_FILTER:
            f["typed_config"].pop("allow_mode_override", None)
            f["typed_config"].pop("allowed_override_modes", None)
    return filters


async def drive(url: str, body: bytes, requests: int, concurrency: int) -> tuple[float, list[float], int]:
    latencies: list[float] = []
    errors = 0
    counter = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal errors
            for _ in counter:
                start = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers={"content-type": "application/json"}) as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - start)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    return requests / elapsed, latencies, errors


async def open_loop(url: str, body: bytes, requests: int, rate: float, seed: int) -> list[float]:
    """Latencies of `requests` sent at Poisson arrivals of `rate` per second, whatever the answers' pace: the
    regime real engines put a picker in (a few to tens of requests a second), where its fixed costs per message
    are not shared with other requests as they are at full concurrency."""
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            start = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as response:
                await response.read()
            latencies.append(time.perf_counter() - start)

        tasks = []
        for _ in range(requests):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return latencies


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Milliseconds of CPU a second each process spends with no request coming (its Envoys' health checks only)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: round((cpu_seconds(pid) - before[name]) / seconds * 1e3, 2) for name, pid in pids.items()}


def body_of(size: int) -> bytes:
    message = {"role": "user", "content": ""}
    base = {"model": "tiny", "messages": [message]}
    filler = "lorem ipsum " * (size // 12 + 1)
    message["content"] = filler[: size - len(json.dumps(base))]
    return json.dumps(base).encode()


def pct(values: list[float], q: float) -> float:
    value = nearest_rank(values, q)
    assert value is not None, "no latencies measured"
    return value


def open_loop_rows(paced: dict[str, tuple[str, int | None, int]], body: bytes, rate: float, requests: int,
                   rounds: int) -> list[dict[str, Any]]:
    """Each setup driven open-loop at `rate`, rounds interleaved: p50 latency and the CPU its ext_proc server and
    its Envoy spent per request."""
    runs: dict[str, list[tuple[list[float], float, float]]] = {name: [] for name in paced}
    for round_ in range(rounds):
        for name, (url, server, envoy) in paced.items():
            server0 = cpu_seconds(server) if server else 0.0
            envoy0 = cpu_seconds(envoy)
            latencies = asyncio.run(open_loop(url, body, requests, rate, seed=round_))
            runs[name].append((latencies, (cpu_seconds(server) - server0) if server else 0.0,
                               cpu_seconds(envoy) - envoy0))
    rows: list[dict[str, Any]] = []
    for name, done in runs.items():
        total = requests * len(done)
        rows.append({"setup": name, "p50_ms": round(pct([x for d in done for x in d[0]], 0.5) * 1e3, 2),
                     "server_cpu_us_per_request": round(sum(d[1] for d in done) / total * 1e6),
                     "envoy_cpu_us_per_request": round(sum(d[2] for d in done) / total * 1e6)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per setup (noise check)")
    parser.add_argument("--rate", type=float, default=9.0,
                        help="open-loop phase: requests per second (0: skip it)")
    parser.add_argument("--rate-requests", type=int, default=300, help="open-loop phase: requests per setup and round")
    parser.add_argument("--idle-seconds", type=float, default=30.0,
                        help="how long the idle picker's and floor's CPU is measured (the clock ticks at 10 ms)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    profile_path = OUT / "picker.prof"
    rows = []
    with process_scope("overhead") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=["--log-level", "WARNING"])
        started.append(picker.process)
        valkey = start_valkey(logdir)
        started.append(valkey.process)
        envoys = {mode: start_envoy(logdir, picker, backends.addresses, mode=mode, name=f"envoy-{mode}")
                  for mode in ("buffered", "full-duplex")}
        started += [e.process for e in envoys.values()]
        shared = start_picker(logdir, endpoints=backends.addresses, name="picker-shared",
                              extra=["--log-level", "WARNING", "--index-backend", "redis", "--redis-url", valkey.url])
        started.append(shared.process)
        envoy_shared = start_envoy(logdir, shared, backends.addresses, name="envoy-shared")
        started.append(envoy_shared.process)
        floor = floor_server.start(logdir, backends.addresses, started)
        envoy_floor = start_envoy(logdir, floor, backends.addresses, name="envoy-floor")
        started.append(envoy_floor.process)
        floor_lib = floor_server.start(logdir, backends.addresses, started, server="grpclib")
        envoy_floor_lib = start_envoy(logdir, floor_lib, backends.addresses, name="envoy-floor-grpclib")
        started.append(envoy_floor_lib.process)
        direct_url, direct = start_direct_envoy(logdir, envoys["buffered"], started)
        kept = start_variant_envoy(logdir, envoys["buffered"], started, "envoy-headers-kept", headers_kept)
        wait_until(kept.picker_healthy, 30, "envoy (response headers kept) sees the picker healthy", kept.process.proc)
        # setup -> (URL, the ext_proc server process whose CPU it costs or None, its Envoy's pid)
        setups = {"envoy direct": (direct_url, None, direct.proc.pid),
                  **{name: (envoy.url, server.process.proc.pid, envoy.process.proc.pid) for name, envoy, server in (
                      ("envoy+picker buffered", envoys["buffered"], picker), (KEPT, kept, picker),
                      ("envoy+picker buffered, redis index", envoy_shared, shared),
                      ("envoy+picker full-duplex", envoys["full-duplex"], picker),
                      (FLOOR, envoy_floor, floor), (FLOOR_GRPCLIB, envoy_floor_lib, floor_lib))}}
        urls = {name: (url, pid) for name, (url, pid, _) in setups.items()}
        for size in (1024, 32 * 1024):
            body = body_of(size)
            results: dict[str, list[tuple[float, list[float], int, float, float]]] = {name: [] for name in urls}
            for _ in range(args.rounds):
                for name, (url, pid) in urls.items():
                    asyncio.run(drive(url, body, 200, args.concurrency))  # warm-up
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    redis0 = cpu_seconds(valkey.process.proc.pid)
                    rps, lat, errors = asyncio.run(drive(url, body, args.requests, args.concurrency))
                    cpu = cpu_seconds(pid) - cpu0 if pid else 0.0
                    redis_cpu = cpu_seconds(valkey.process.proc.pid) - redis0
                    results[name].append((rps, lat, errors, cpu, redis_cpu))
            # Added latency at concurrency 1 (no queueing): p50 of 300 sequential requests.
            single = {name: statistics.median(asyncio.run(drive(url, body, 300, 1))[1])
                      for name, (url, _) in urls.items()}
            direct_rps = statistics.median(r[0] for r in results["envoy direct"])
            for name, runs in results.items():
                rps = statistics.median(r[0] for r in runs)
                lat = [x for r in runs for x in r[1]]
                per_request = args.requests * len(runs)
                rows.append({"setup": name, "body": f"{size // 1024} KB", "req_per_s": round(rps),
                             "ratio_to_direct": round(rps / direct_rps, 3), "p50_ms": round(pct(lat, 0.5) * 1e3, 2),
                             "p99_ms": round(pct(lat, 0.99) * 1e3, 2),
                             "p50_ms_concurrency_1": round(single[name] * 1e3, 2),
                             "picker_cpu_us_per_request": round(sum(r[3] for r in runs) / per_request * 1e6),
                             "valkey_cpu_us_per_request": round(sum(r[4] for r in runs) / per_request * 1e6),
                             "errors": sum(r[2] for r in runs)})
        rate_rows: list[dict[str, Any]] = []
        if args.rate > 0:
            paced = {name: setups[name] for name in ("envoy direct", "envoy+picker buffered", KEPT, FLOOR,
                                                     FLOOR_GRPCLIB)}
            rate_rows = open_loop_rows(paced, body_of(1024), args.rate, args.rate_requests, args.rounds)
        idle_checkers = len(envoys) + 1  # the buffered and full-duplex Envoys, and the one keeping response headers
        idle = idle_cpu({"picker": picker.process.proc.pid, "floor": floor.process.proc.pid,
                         "floor on grpclib": floor_lib.process.proc.pid}, args.idle_seconds)
        # A second picker under cProfile (slower, so not used for the figures above) shows where time goes.
        profiled = start_picker(logdir, endpoints=backends.addresses, extra=["--log-level", "WARNING"],
                                name="picker-profiled", profile_to=profile_path)
        started.append(profiled.process)
        envoy = start_envoy(logdir, profiled, backends.addresses, name="envoy-profiled")
        started.append(envoy.process)
        asyncio.run(drive(envoy.url, body_of(1024), args.requests, args.concurrency))
        profiled.process.proc.send_signal(signal.SIGTERM)
        profiled.process.proc.wait(15)
    header = list(rows[0])
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows]
    for size in sorted({row["body"] for row in rows}):
        cost = {row["setup"]: row["picker_cpu_us_per_request"] for row in rows if row["body"] == size}
        floor_cost = cost[FLOOR]
        table.append(f"\n{size}: picker buffered CPU per request {cost['envoy+picker buffered']} µs = "
                     f"{cost['envoy+picker buffered'] / floor_cost:.2f}x the floor's {floor_cost} µs "
                     f"({cost[KEPT]} µs = {cost[KEPT] / floor_cost:.2f}x with the response headers sent); the floor "
                     f"on grpclib {cost[FLOOR_GRPCLIB]} µs")
    if rate_rows:
        table += ["", f"Open loop, {args.rate:g} requests/s (Poisson), 1 KB, {args.rate_requests} requests x "
                  f"{args.rounds} rounds per setup: CPU per request at the rate real engines serve (the processes' "
                  "background work included)", "",
                  "| setup | p50 ms | ext_proc server CPU µs/request | its Envoy's | together |", "|---|---|---|---|---|"]
        table += [f"| {r['setup']} | {r['p50_ms']} | {r['server_cpu_us_per_request']} | "
                  f"{r['envoy_cpu_us_per_request']} | {r['server_cpu_us_per_request'] + r['envoy_cpu_us_per_request']} |"
                  for r in rate_rows]
    table += ["", f"Idle ({args.idle_seconds:g} s, no requests): picker {idle['picker']} ms of CPU a second, health-checked "
              f"by {idle_checkers} Envoys (buffered, full-duplex, response headers sent); floor {idle['floor']}, by "
              f"one; floor on grpclib {idle['floor on grpclib']}, by one"]
    text = "\n".join(table)
    print(text)
    (OUT / "overhead.md").write_text(text + "\n")
    (OUT / "overhead.json").write_text(json.dumps({"rows": rows, "open_loop": rate_rows, "idle_ms_per_s": idle,
                                                   "rate": args.rate, "requests": args.requests,
                                                   "concurrency": args.concurrency, "cpus": os.cpu_count()},
                                                  indent=2))
    if profile_path.exists():
        print("\nWhere the picker's time goes (buffered, 1 KB; own time, top 20):")
        pstats.Stats(str(profile_path)).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
