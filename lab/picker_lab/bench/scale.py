"""`picker bench --scenario scale`: the envelope of one picker process as the pool grows.

In-process, single-threaded, on simulated pods (`Endpoint`s whose metrics are set, no network): for each pool size,
the decision (`Director.place`, the whole step `picker serve` runs once a request is admitted: schedule, learn the
pick, account for it) on a steady workload of 32 shared prefixes (three quarters of each prompt) and unique tails,
with about four requests in flight per pod; the most decisions per second that leaves (1 / mean); what scraping the
pool costs (parsing one real vLLM 0.32 /metrics page, times one scrape per pod per second: the calm cadence); and
the prefix index's memory per 100k cached prefixes; what replicas sharing their load cost Valkey (a local one: each
replica's report, one sync's round trip and bytes, per pool size and replica count). Wall-clock per call
(`time.perf_counter_ns`); this machine's speed moves between runs, so compare sizes within a run. Every decision
figure twice: with the default profiles (whose `candidate-sample-filter` scores a sample of 256 candidates or more),
and with every pod scored; then what the sampling costs in routing, in fast mode (the same trace through both,
simulated llama3-8b-h100 pods at 0.8 load). Out of process, with real Envoy and `picker serve` on echo pods: the
round trip of sequential requests at 8 and 1,000 pods, and what the idle picker spends scraping them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from picker.core.requests import ApiKind, InferenceRequest
from picker.endpoints.metrics import parse_vllm_metrics
from picker.endpoints.pool import EndpointPool
from picker.endpoints.shared_load import SharedLoad, sync_period
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.prefix.hashing import prefix_keys, prefix_seed
from picker.prefix.memory import InMemoryPrefixIndex
from picker.routing.director import Director
from picker.scheduling.config import DEFAULT_CONFIG, build_scheduler
from picker.serving.config import ServeConfig
from picker_lab.bench.capacity import cost_per_request, rate_for_load
from picker_lab.bench.configs import every_pod_scheduling
from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.summary import summarize
from picker_lab.bench.workloads import FleetSpec, generate
from picker_lab.sim.profiles import get_profile

SYNC_INTERVAL: float = ServeConfig.model_fields["shared_load_interval"].default  # picker serve's shared load
# A real vLLM 0.32 CPU server's /metrics page (idle), as the scraper parses it.
METRICS_PAGE = Path(__file__).resolve().parent / "data" / "vllm-0.32-cpu-idle.txt"
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this",
         "are", "or", "an", "at", "from", "model", "cache", "token")


@dataclass(frozen=True, slots=True)
class ScaleSpec:
    pools: tuple[int, ...] = (64, 256, 1000, 4000)
    decisions: int = 2000  # timed per pool size (after a warm-up that fills the index)
    prompt_chars: int = 2048
    replicas: tuple[int, ...] = (4, 16)  # replica counts whose shared load is measured, per pool size
    syncs: int = 100  # timed load syncs per replica
    seed: int = 1
    # The sizing table's inputs measured elsewhere, by `make overhead` (docs/costs.md, "Against the floor": 1 KB
    # bodies, buffered, 8 pods): the picker's CPU per request through Envoy, and Valkey's per request with the
    # shared index (one replica writing, one reading)
    request_cpu_us: float = 1244.0
    valkey_cpu_us: float = 24.0
    rates: tuple[int, ...] = (1_000, 10_000, 50_000)  # the sizing table's fleet-wide request rates
    index_prefixes: int = 100_000  # cached prefixes whose memory is measured
    # (pods, requests, workloads) of the routing comparison, every pod scored against the sampled few
    routing: tuple[tuple[int, int, tuple[str, ...]], ...] = (
        (256, 4000, ("shared-prefix", "chat", "zipf-prefix")), (1024, 8000, ("chat", "zipf-prefix")))
    round_trip_pools: tuple[int, ...] = (8, 1000)  # echo pods behind Envoy and `picker serve`, one size at a time
    round_trips: int = 1000  # timed sequential requests per pool size (after as many to warm up)
    idle_window_s: float = 3.0  # how long the idle picker's CPU is measured before them


def words_text(rng: random.Random, chars: int) -> str:
    """`chars` characters of common English words (what prompts are cut into blocks and hashed from)."""
    out: list[str] = []
    n = 0
    while n < chars:
        word = rng.choice(WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


def simulated_pods(n: int, rng: random.Random) -> list[Endpoint]:
    """`n` pods serving the model "llama" (vLLM labels its series with it), with varied queues and KV use, scraped
    at time 0."""
    endpoints = []
    for i in range(n):
        e = Endpoint.from_address(f"10.{i // 250}.{i % 250}.1:8000")
        e.metrics = EndpointMetrics(waiting=rng.randint(0, 4), running=rng.randint(0, 8), kv_usage=rng.random() * 0.7,
                                    models=frozenset({"llama"}), block_size=16, num_gpu_blocks=30_000, updated_at=0.0)
        endpoints.append(e)
    return endpoints


def _pool(n: int, rng: random.Random) -> EndpointPool:
    endpoints = simulated_pods(n, rng)
    pool = EndpointPool()
    pool.set_endpoints(endpoints)
    for e in endpoints:
        pool.mark_ready(e)
    return pool


def decisions(pods: int, spec: ScaleSpec, sampled: bool = True) -> dict[str, float]:
    """p50/p99/mean µs of `Director.place` on a pool of `pods`, and the decisions per second that mean allows;
    `sampled`: the defaults (a large pool's candidates sampled), else every pod scored."""
    rng = random.Random(spec.seed * 7919 + pods)
    pool = _pool(pods, rng)
    director = Director(pool, build_scheduler(None if sampled else every_pod_scheduling(), rng=random.Random(spec.seed)))
    prefixes = [words_text(rng, spec.prompt_chars * 3 // 4) for _ in range(32)]
    prompts = [rng.choice(prefixes) + words_text(rng, spec.prompt_chars // 4) for _ in range(256)]
    live = []
    samples: list[int] = []
    warm_up = min(4 * pods, 4000)
    gc.collect()
    for i in range(warm_up + spec.decisions):
        request = InferenceRequest(f"r{i}", "llama", api=ApiKind.COMPLETIONS, prompt_text=prompts[i % len(prompts)],
                                   session_id=f"s{i % 97}" if i % 3 == 0 else None)
        now = i * 0.001
        began = time.perf_counter_ns()
        decision = director.place(request, now)
        took = time.perf_counter_ns() - began
        live.append(decision)
        if len(live) > 4 * pods:  # a steady in-flight population
            director.release(live.pop(rng.randrange(len(live))))
        if i >= warm_up:
            samples.append(took)
    spread = _micros([s / 1000 for s in samples])
    return {"pods": pods, "sampled": sampled, **spread, "decisions_per_s": 1e6 / spread["mean_us"]}


def _micros(values: list[float]) -> dict[str, float]:
    """p50, p99 and mean of some timings in µs."""
    ordered = sorted(values)
    return {"p50_us": ordered[len(ordered) // 2], "p99_us": ordered[int(len(ordered) * 0.99)],
            "mean_us": statistics.fmean(ordered)}


def scrape_cost(iterations: int = 500) -> dict[str, float]:
    """µs to parse one vLLM /metrics page, and the CPU share one scrape per pod per second costs per 1,000 pods."""
    page = METRICS_PAGE.read_text()
    samples = []
    for _ in range(iterations):
        began = time.perf_counter_ns()
        parse_vllm_metrics(page, 0.0)
        samples.append(time.perf_counter_ns() - began)
    parse_us = statistics.median(samples) / 1000
    return {"page_bytes": len(page.encode()), "parse_us": parse_us, "cores_per_1000_pods_at_1s": parse_us * 1000 / 1e6}


def index_memory(prefixes: int = 100_000, pods: int = 64, blocks_per_prefix: int = 8) -> dict[str, float]:
    """Bytes the in-memory index holds for `prefixes` cached prefixes of `blocks_per_prefix` blocks on one pod each."""
    rng = random.Random(9)
    addresses = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(pods)]
    index = InMemoryPrefixIndex(default_capacity=prefixes * blocks_per_prefix, ttl=None)
    seed = prefix_seed("m")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(prefixes):
        keys = prefix_keys(f"prefix {i} " + "x" * (64 * blocks_per_prefix), seed, 64, blocks_per_prefix)
        index.record(keys[:blocks_per_prefix], rng.choice(addresses), float(i))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"prefixes": prefixes, "blocks_per_prefix": blocks_per_prefix, "entries": index.size(),
            "mb": used / 1e6, "bytes_per_entry": used / max(1, index.size())}


def routing_cost(spec: ScaleSpec) -> list[dict[str, Any]]:
    """Hit rate and latencies of the same fast-mode trace routed with every pod scored and with the sample."""
    profile = get_profile("llama3-8b-h100")
    rows = []
    for pods, requests, workloads in spec.routing:
        fleet = FleetSpec(profile, pods)
        for workload in workloads:
            rate = rate_for_load(0.8, pods, cost_per_request(workload, fleet, spec.seed))
            trace = generate(workload, requests, rate, spec.seed, fleet)
            for sampled, scheduling in ((False, every_pod_scheduling()), (True, DEFAULT_CONFIG)):
                r = summarize(run_fast(trace, "picker", FastConfig(profile, pods, seed=spec.seed),
                                       scheduling=scheduling))
                rows.append({"workload": workload, "pods": pods, "sampled": sampled,
                             **{k: r[k] for k in ("hit_rate", "ttft_mean", "ttft_p90", "ttft_p99", "itl_p95")}})
    return rows


def shared_load_cost(spec: ScaleSpec) -> list[dict[str, Any]]:
    """Per pool size and replica count, on a local Valkey: one replica's report (every pod with requests in flight
    from it: 0-2 each), and one sync (`SharedLoad.sync_once`: write it, read every replica's) in wall time and bytes
    read."""
    from picker_lab.supervisor import process_scope, start_valkey

    rows = []
    with process_scope("scale-valkey") as (logdir, started):
        valkey = start_valkey(logdir)
        started.append(valkey.process)
        for pods in spec.pools:
            for replicas in spec.replicas:
                rows.append(asyncio.run(_syncs(valkey.url, pods, replicas, spec)))
    return rows


async def _syncs(url: str, pods: int, replicas: int, spec: ScaleSpec) -> dict[str, Any]:
    rng = random.Random(spec.seed)
    loads = []
    for r in range(replicas):
        view = simulated_pods(pods, rng)
        for e in view:
            for _ in range(rng.randint(0, 2)):
                e.start_request(rng.randint(100, 2000), 0.0)
        loads.append(SharedLoad(url, f"scale-{pods}-{replicas}", _constant(view), interval=SYNC_INTERVAL,
                                replica_id=f"r{r}"))
    first = loads[0]
    try:
        for load in loads:
            await load.sync_once()
        before = first.stats.bytes_received
        times = []
        for _ in range(spec.syncs):
            started = time.perf_counter_ns()
            await first.sync_once()
            times.append((time.perf_counter_ns() - started) / 1000)
        report = first.stats.bytes_sent / first.stats.syncs
        received = (first.stats.bytes_received - before) / spec.syncs
    finally:
        for load in loads:
            await load.close()
    spread = _micros(times)
    return {"pods": pods, "replicas": replicas, "report_bytes": report, "received_bytes": received,
            "sync_p50_us": spread["p50_us"], "sync_p99_us": spread["p99_us"]}


def _constant(pods: list[Endpoint]) -> Callable[[], list[Endpoint]]:
    return lambda: pods


BUSY = 0.7  # the share of a core a replica is sized to use, leaving room for bursts


def sizing(section: dict[str, Any], spec: ScaleSpec) -> list[dict[str, Any]]:
    """Replicas and Valkey load for each fleet-wide rate and large pool: a replica's CPU per request is what `make
    overhead` measured at 8 pods plus what the decision costs at this pool size beyond 64 pods (the defaults, which
    sample a large pool's candidates); Valkey carries the shared index (each replica reads every
    pick: `valkey_cpu_us` per request and reader) and the shared load (20 syncs a second per replica, slower when a
    sync takes long; bytes as measured with the nearest replica count)."""
    sampled = {r["pods"]: r for r in section["decisions"] if r["sampled"]}
    base = sampled[min(sampled)]["mean_us"]
    loads = section["shared_load"]
    rows = []
    for pods in [p for p in spec.pools if p >= 1000]:
        per_request = spec.request_cpu_us + max(0.0, sampled[pods]["mean_us"] - base)
        for rate in spec.rates:
            replicas = max(2, math.ceil(rate * per_request / 1e6 / BUSY))
            nearest = min((r for r in loads if r["pods"] == pods), key=lambda r: abs(r["replicas"] - replicas))
            period = sync_period(SYNC_INTERVAL, nearest["sync_p50_us"] / 1e6)
            per_sync = nearest["received_bytes"] * replicas / nearest["replicas"]  # every replica's report
            rows.append({"pods": pods, "rate": rate, "cpu_per_request_us": per_request, "replicas": replicas,
                         "valkey_index_cores": rate * spec.valkey_cpu_us * replicas / 1e6,
                         "load_syncs_per_s": replicas / period, "load_read_mb_s": replicas * per_sync / period / 1e6,
                         "measured_replicas": nearest["replicas"]})
    return rows


def round_trips(spec: ScaleSpec) -> list[dict[str, Any]]:
    """Per pool size, the client's round trip of sequential chat requests (2,048 characters over 32 shared prefixes)
    through Envoy and a `picker serve` process to echo pods ("tiny") that answer /metrics as vLLM does (`picker_lab.echo`,
    one process, each pod on its own loopback address): what the pool's size adds to a request through ext_proc,
    scraping included. One size at a time, so one pool's scraping does not slow the other's requests."""
    rng = random.Random(spec.seed)
    prefixes = [words_text(rng, spec.prompt_chars * 3 // 4) for _ in range(32)]
    bodies = [json.dumps({"model": "tiny", "messages": [{"role": "user", "content": rng.choice(prefixes)
                                                          + words_text(rng, spec.prompt_chars // 4)}]}).encode()
              for _ in range(256)]
    rows = []
    for pods in spec.round_trip_pools:
        times, idle_cores = _round_trips(pods, bodies, spec.round_trips, spec.idle_window_s)
        rows.append({"pods": pods, "requests": len(times), **_micros([t * 1e6 for t in times]),
                     "idle_cores": idle_cores})
    return rows


def _round_trips(pods: int, bodies: list[bytes], count: int, idle_window: float) -> tuple[list[float], float]:
    """The round trips of `count` requests through a fresh Envoy + picker on `pods` echo pods, and the cores the
    picker used while idle before them."""
    from picker_lab.bench.real import picker_scrapes
    from picker_lab.supervisor import (
        cpu_seconds,
        free_port,
        process_scope,
        python_module,
        spawn,
        start_envoy,
        start_picker,
        wait_until,
    )

    with process_scope(f"scale-round-trip-{pods}") as (logdir, started):
        port = free_port()
        pool = [f"127.{1 + i // 62500}.{i // 250 % 250}.{1 + i % 250}:{port}" for i in range(pods)]
        echo = spawn("echo", [*python_module("picker_lab.echo"), *pool], logdir)
        started.append(echo)
        wait_until(lambda: "ready" in echo.log(), 60, "echo pods", echo.proc)
        picker = start_picker(logdir, endpoints=pool, extra=["--log-level", "WARNING"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pool)
        started.append(envoy.process)
        wait_until(lambda: len(picker_scrapes(picker.metrics_port)) >= pods, 60, "every pod scraped",
                   picker.process.proc)
        # the idle picker's CPU over a window: scraping the pool at its calm cadence (and the rest it does unasked)
        pid, began, cpu = picker.process.proc.pid, time.monotonic(), cpu_seconds(picker.process.proc.pid)
        time.sleep(idle_window)
        idle = (cpu_seconds(pid) - cpu) / (time.monotonic() - began)
        return asyncio.run(_sequential(envoy.url, bodies, count)), idle


async def _sequential(url: str, bodies: list[bytes], count: int) -> list[float]:
    """`count` timed requests one after another (after as many untimed), each must answer 200."""
    import aiohttp

    times = []
    async with aiohttp.ClientSession() as session:
        for i in range(2 * count):
            began = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=bodies[i % len(bodies)],
                                    headers={"content-type": "application/json"}) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"round trip {i}: HTTP {response.status}")
            if i >= count:
                times.append(time.perf_counter() - began)
    return times


def run_scale(spec: ScaleSpec, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    section = {"spec": {"pools": list(spec.pools), "decisions": spec.decisions, "prompt_chars": spec.prompt_chars},
               "decisions": [decisions(n, spec, sampled) for n in spec.pools for sampled in (False, True)],
               "scrape": scrape_cost(),
               "index": index_memory(spec.index_prefixes), "shared_load": shared_load_cost(spec),
               "routing": routing_cost(spec), "round_trips": round_trips(spec)}
    section["sizing"] = sizing(section, spec)
    (out / "scale.json").write_text(json.dumps(section, indent=1))
    (out / "scale.md").write_text(render(section))
    return section


def render(section: dict[str, Any]) -> str:
    spec, scrape, index = section["spec"], section["scrape"], section["index"]
    lines = ["# One picker process as the pool grows", "",
             f"`Director.place` on simulated pods, {spec['decisions']} timed decisions per size, "
             f"{spec['prompt_chars']}-character prompts (32 shared prefixes, unique tails), ~4 in flight per pod.", "",
             "| pods | scheduling | decision p50 µs | p99 µs | mean µs | decisions/s (1 / mean) |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in section["decisions"]:
        kind = "defaults (sampled)" if row["sampled"] else "every pod scored"
        lines.append(f"| {row['pods']} | {kind} | {row['p50_us']:.0f} | {row['p99_us']:.0f} | {row['mean_us']:.0f} | "
                     f"{row['decisions_per_s']:.0f} |")
    trips = section.get("round_trips") or []
    if trips:
        base = trips[0]
        lines += ["", f"Through Envoy and a `picker serve` process to echo pods that answer /metrics as vLLM does "
                  f"({base['requests']} sequential chat requests per pool size, each size on its own):", "",
                  "| pods | round trip p50 µs | p99 µs | mean µs | p50 / p99 vs " + f"{base['pods']} pods | "
                  "idle picker, cores (scraping) |",
                  "|---:|---:|---:|---:|---|---:|"]
        lines += [f"| {r['pods']:,} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['mean_us']:.0f} | "
                  f"{r['p50_us'] / base['p50_us']:.2f}x / {r['p99_us'] / base['p99_us']:.2f}x | "
                  f"{r['idle_cores']:.3f} |" for r in trips]
    lines += ["", f"Scraping: one vLLM /metrics page ({scrape['page_bytes']:,} bytes) parses in {scrape['parse_us']:.0f} µs; "
              f"one scrape per pod per second costs {scrape['cores_per_1000_pods_at_1s']:.2f} cores per 1,000 pods "
              "in parsing alone (HTTP not counted).", "",
              f"Prefix index: {index['prefixes']:,} prefixes of {index['blocks_per_prefix']} blocks "
              f"({index['entries']:,} entries) hold {index['mb']:.0f} MB ({index['bytes_per_entry']:.0f} bytes an "
              "entry).", "",
              "Shared load on a local Valkey (`--shared-load-interval` 50 ms, longer when a sync takes over 5 % of "
              "that: each sync one pipelined HSET + HGETALL; 0-2 requests in flight per pod from each replica):", "",
              "| pods | replicas | report bytes (one replica) | bytes read per sync | sync p50 µs | p99 µs | "
              "period (>= 20 x p50) | read per replica |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in section["shared_load"]:
        period = sync_period(SYNC_INTERVAL, r["sync_p50_us"] / 1e6)
        lines.append(f"| {r['pods']:,} | {r['replicas']} | {r['report_bytes']:,.0f} | {r['received_bytes']:,.0f} | "
                     f"{r['sync_p50_us']:.0f} | {r['sync_p99_us']:.0f} | {period * 1e3:.0f} ms | "
                     f"{r['received_bytes'] / period / 1e6:.2f} MB/s |")
    lines += ["",
              "What sampling costs in routing (fast mode, llama3-8b-h100 pods at 0.8 load, the same trace for both):", "",
              "| workload | pods | scheduling | hit rate | TTFT mean ms | p90 | p99 | ITL p95 |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['pods']:,} | {'defaults (sampled)' if r['sampled'] else 'every pod'} | "
              f"{r['hit_rate']:.3f} | {r['ttft_mean'] * 1e3:.1f} | {r['ttft_p90'] * 1e3:.1f} | "
              f"{r['ttft_p99'] * 1e3:.1f} | {r['itl_p95'] * 1e3:.1f} |" for r in section["routing"]]
    if section.get("sizing"):
        lines += ["", "Sizing (default scheduling; a replica's CPU per request: `make overhead`'s at 8 pods plus this "
                  "run's decision beyond 64 pods; replicas at 70 % of a core each; Valkey: the shared index at its "
                  "measured CPU per request and reader, the shared load's syncs and bytes read from the table above):",
                  "", "| pods | req/s | CPU µs/request | replicas | Valkey cores, shared index | shared-load syncs/s, all "
                  "replicas | shared-load MB/s read, all replicas |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['pods']:,} | {r['rate']:,} | {r['cpu_per_request_us']:,.0f} | {r['replicas']} | "
                  f"{r['valkey_index_cores']:.2f} | {r['load_syncs_per_s']:,.0f} | {r['load_read_mb_s']:,.1f} |"
                  for r in section["sizing"]]
    return "\n".join(lines) + "\n"
