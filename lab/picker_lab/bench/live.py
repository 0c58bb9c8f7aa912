"""Live mode: one `picker sim` fleet, the same trace replayed through each router over real HTTP/gRPC.

Routers, one at a time on the same pods (prefix caches reset in between):
- round-robin: Envoy with the ext_proc filter removed (the no-picker baseline);
- random, least-load, prefix-only, prefix-hash, picker: Envoy + `picker serve --strategy NAME`;
  picker-predicted-ttft: the picker with PREDICTED_TTFT_CONFIG as its scheduler;
- sglang-router and vllm-router in cache_aware mode (peers.py), skipped with the reason when unavailable.
Hit rates come from the pods' own counters (/metrics before and after), latencies from the client.

All simulated pods share one Python process, so the picker's /metrics scrapes of every pod cost the *simulated
GPUs* CPU time (a real vLLM serves /metrics from its API server, not from the engine). So that no router is
slowed by another's probes, routers that do not scrape (Envoy round-robin, the peers) run with a scrape of every
pod at the picker's calm cadence (1 s) added by the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import re
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from picker.endpoints.metrics import parse_metrics
from picker.serving.envoyconfig import EnvoySettings, envoy_binary, http_managers, instrumented, render
from picker_lab.bench import peers
from picker_lab.bench.capacity import cost_per_request, rate_for_load
from picker_lab.bench.client import replay
from picker_lab.bench.configs import predicted_ttft_scheduling
from picker_lab.bench.oracle import InfiniteCacheOracle
from picker_lab.bench.progress import ProgressBar
from picker_lab.bench.prompts import PromptBuilder
from picker_lab.bench.results import RunResult
from picker_lab.bench.summary import ratios_to, summarize, ttft_sample
from picker_lab.bench.workloads import FleetSpec, generate
from picker_lab.sim.profiles import Profile, get_profile
from picker_lab.sim.tokenizer import Tokenizer
from picker_lab.supervisor import (
    HOST,
    Managed,
    Picker,
    PickerFleet,
    Valkey,
    cpu_seconds,
    free_port,
    port_open,
    process_scope,
    spawn,
    start_picker_fleet,
    start_sim,
    start_valkey,
    wait_until,
)

PREDICTED_TTFT = "picker-predicted-ttft"  # the picker with PREDICTED_TTFT_CONFIG as its scheduler
DEFAULT_ROUTERS = ("round-robin", "random", "least-load", "prefix-only", "picker", *peers.PEERS)
PICKER_STRATEGIES = ("random", "least-load", "prefix-only", "prefix-hash", "picker", PREDICTED_TTFT)
INDEXED = ("picker", "prefix-only", PREDICTED_TTFT)  # the strategies with a prefix index replicas can share


@dataclass(frozen=True)
class LiveSpec:
    workload: str = "shared-prefix"
    pods: int = 4
    requests: int = 300
    load: float = 0.8
    time_scale: float = 0.5
    profile: str = "llama3-8b-h100"
    num_gpu_blocks: int | None = 2500
    seed: int = 1
    # the routers in the order they run, as asked, peers included (a repeated bench reverses it so that no router
    # always runs last)
    order: tuple[str, ...] = DEFAULT_ROUTERS
    scheduling_file: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LiveSpec:
        smoke = bool(args.smoke)
        asked = args.strategies or DEFAULT_ROUTERS
        if args.peers is not None:  # --peers decides which peers run: those named in --strategies keep their place
            wanted = tuple(p for p in args.peers if p and p != "none")
            asked = tuple(s for s in asked if not peers.is_peer(s) or s in wanted) + tuple(
                p for p in wanted if p not in asked)
        return cls(
            workload=args.live_workload,
            pods=args.live_pods or (3 if smoke else 4),
            requests=args.live_requests or (90 if smoke else 300),
            load=args.live_load if args.live_load is not None else 0.8,
            time_scale=args.live_time_scale or cls.time_scale,
            profile=args.profile,
            num_gpu_blocks=args.num_gpu_blocks or 2500,
            seed=args.seed,
            order=tuple(asked),
            scheduling_file=args.scheduling,
        )

    @property
    def strategies(self) -> tuple[str, ...]:
        """The routers we start ourselves: the picker's strategies and Envoy round-robin."""
        return tuple(s for s in self.order if not peers.is_peer(s))

    @property
    def peers(self) -> tuple[str, ...]:
        """The peer routers (peers.PEERS), each in its own venv (in any number of replicas)."""
        return tuple(s for s in self.order if peers.is_peer(s))

    def get_profile(self) -> Profile:
        return get_profile(self.profile).with_overrides(num_gpu_blocks=self.num_gpu_blocks)


# --- pods' /metrics ----------------------------------------------------------------------------------------------
_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:prompt_tokens_cached_total": "prompt_tokens_cached",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:request_success_total": "requests",
}
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def parse_counters(text: str) -> dict[str, float]:
    """The counters/gauges the benchmark reads, summed over label sets."""
    out: dict[str, float] = dict.fromkeys(_COUNTERS.values(), 0.0)
    for name, value in _SAMPLE.findall(text):
        key = _COUNTERS.get(name)
        if key is not None:
            out[key] += float(value)
    return out


def read_counters(url: str) -> dict[str, float]:
    """One server's counters (parse_counters), read once, blocking: for the benchmarks' before/after readings."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_counters(resp.read().decode())


async def scrape(session: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        async with session.get(url + "/metrics") as resp:
            return parse_counters(await resp.text())

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def reset_caches(session: aiohttp.ClientSession, urls: list[str], within_s: float = 30.0) -> None:
    """Empty every pod's prefix cache (vLLM refuses while requests hold blocks: retry until idle)."""
    deadline = time.monotonic() + within_s
    for url in urls:
        while True:
            async with session.post(url + "/reset_prefix_cache") as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} kept refusing /reset_prefix_cache")
            await asyncio.sleep(0.2)


async def sample_load(session: aiohttp.ClientSession, urls: list[str], res: RunResult, start: float,
                      scale: float, stop: asyncio.Event, period: float = 0.5) -> None:
    """Per-pod running + waiting over time, read from /metrics."""
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            snap = await scrape(session, urls)
            res.load_times.append((time.monotonic() - start) * scale)
            res.load_per_pod.append([int(s["running"] + s["waiting"]) for s in snap])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


async def equal_scrape(session: aiohttp.ClientSession, urls: list[str], stop: asyncio.Event,
                       period: float = 1.0) -> None:
    """What `picker serve` does to the pods: GET and parse every pod's /metrics every `period` seconds."""

    async def one(url: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url + "/metrics") as resp:
                parse_metrics(await resp.text())

    while not stop.is_set():
        await asyncio.gather(*(one(u) for u in urls))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


# --- routers -------------------------------------------------------------------------------------------------------
def start_direct_envoy(logdir: Path, pool: list[str], *, served_by: str = "",
                       timing_log: Path | None = None, name: str = "envoy-direct") -> tuple[Managed, str]:
    """Envoy rendered from our own template with the ext_proc filter taken out: plain round-robin over the pool
    (the fail-open route), i.e. Envoy with no picker; over router replicas, the load balancer in front of them.
    `served_by`, `timing_log`: as `start_envoy`'s."""
    settings = EnvoySettings(listen_port=free_port(), admin_port=free_port(), picker_port=free_port(),
                             picker_health_port=free_port(), pool=tuple(pool))
    config = yaml.safe_load(render(settings))
    for hcm in http_managers(config):
        if "http_filters" in hcm:
            hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
        for host in hcm.get("route_config", {}).get("virtual_hosts", []):
            for route in host["routes"]:
                # A member that is down (a router replica restarting, a pod): the request, never started there,
                # goes to another, as a load balancer's retries or a Service's readiness would see to.
                route["route"]["retry_policy"] = {
                    "retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": 3,
                    "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3"
                                 ".PreviousHostsPredicate"}}]}
    path = logdir / f"{name}.yaml"
    path.write_text(instrumented(yaml.safe_dump(config), served_by, timing_log))
    proc = spawn(name, [envoy_binary(), "-c", str(path), "--base-id", str(settings.admin_port),
                        "-l", "warning", "--concurrency", "1"], logdir)
    wait_until(lambda: port_open(settings.listen_port), 30, name, proc.proc)
    return proc, f"http://{HOST}:{settings.listen_port}"


@dataclass
class Router:
    """A router as started for a run: every process it took (stopped after the run, its CPU counted), the URL
    clients send to, and what a fleet scenario (lab/picker_lab/bench/fleet.py) disrupts: its replicas, each with a check
    that says it serves again after a restart, and the Valkey its replicas share."""

    processes: list[Managed]
    url: str
    replicas: list[tuple[Managed, Callable[[], bool]]] = field(default_factory=list)
    valkey: Valkey | None = None
    pickers: list[Picker] = field(default_factory=list)  # the picker's replicas (their Explain API)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def start_router(strategy: str, spec: LiveSpec, pool: list[str], urls: list[str], logdir: Path) -> Router:
    """The router for `strategy` (RuntimeError when it cannot start): one process, or `name@N` replicas behind
    one load balancer (peers.replicated) as a gateway runs them: Envoy round-robin over a peer's processes, the
    picker's own Envoy over pickers sharing their index and load through a Valkey."""
    try:
        name, replicas, mesh = peers.replicated(strategy)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    if name == "round-robin":
        direct, url = start_direct_envoy(logdir, pool)
        return Router([direct], url)
    if name in peers.PEERS:
        procs, url, routers = start_peer_fleet(strategy, urls, logdir)
        ready = [functools.partial(peers.ready, int(u.rsplit(":", 1)[1])) for u in routers]
        return Router(procs, url, list(zip(procs[:len(routers)], ready, strict=True)))  # the replicas, not their Envoy
    strategy = name
    if strategy == PREDICTED_TTFT:
        extra = ["--strategy", "picker", "--config-file", str(predicted_ttft_config(logdir, spec.time_scale)),
                 "--log-level", "WARNING"]
    else:
        extra = ["--strategy", strategy, "--log-level", "WARNING"]
    if spec.scheduling_file and strategy == "picker":
        extra += ["--config-file", _serve_config(spec.scheduling_file, logdir)]
    # replicas of a strategy with a prefix index share it and their load, as deployed (a hash is stateless)
    procs, fleet, valkey = start_picker_replicas(logdir, pool, extra, replicas, strategy,
                                                 shared=replicas > 1 and strategy in INDEXED)
    ready = [functools.partial(port_open, p.grpc_port, p.host) for p in fleet.pickers]
    return Router(procs, fleet.envoy.url, list(zip((p.process for p in fleet.pickers), ready, strict=True)),
                  valkey, fleet.pickers)


def start_peer_fleet(strategy: str, worker_urls: list[str], logdir: Path) -> tuple[list[Managed], str, list[str]]:
    """A peer as `NAME[-mesh][@N]` names it (peers.replicated): its processes (and, for several, the Envoy
    round-robin in front of them, as a load balancer in front of a Deployment), the URL clients send to, and each
    replica's own URL."""
    name, replicas, mesh = peers.replicated(strategy)
    procs, routers = peers.start_replicas(peers.PEERS[name], worker_urls, logdir, replicas, mesh)
    if replicas == 1:
        return procs, routers[0], routers
    try:
        front, url = start_direct_envoy(logdir, [u.removeprefix("http://") for u in routers],
                                        name=f"envoy-{strategy.replace('@', '-')}")
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return [*procs, front], url, routers


def start_picker_replicas(logdir: Path, pool: list[str], flags: list[str], replicas: int, name: str, *,
                          shared: bool, **fleet: Any) -> tuple[list[Managed], PickerFleet, Valkey | None]:
    """`replicas` `picker serve` processes behind their Envoy (start_picker_fleet, given `fleet`'s keywords), with
    `shared`: sharing their prefix index and load through a fresh Valkey. Returns every process, the fleet and the
    Valkey; whatever started is stopped again when a step fails."""
    valkey = start_valkey(logdir, name=f"valkey-{name}") if shared else None
    if valkey is not None:
        flags = [*flags, "--index-backend", "redis", "--redis-url", valkey.url]
    try:
        started = start_picker_fleet(logdir, pool, flags=flags, replicas=replicas, name=f"picker-{name}", **fleet)
    except BaseException:
        if valkey is not None:
            valkey.process.stop()
        raise
    return [*([valkey.process] if valkey is not None else []), *started.processes], started, valkey


def predicted_ttft_config(logdir: Path, time_scale: float) -> Path:
    """A `picker serve --config-file` with PREDICTED_TTFT_CONFIG as its scheduler (the picker-predicted-ttft
    router), its scorer told the sim pods' time scale (they report model seconds; it keeps its queues on their
    clock)."""
    path = logdir / "predicted-ttft.yaml"
    path.write_text(yaml.safe_dump({"scheduling": predicted_ttft_scheduling(podTimeScale=time_scale)}))
    return path


def router_cpu(procs: list[Managed]) -> float:
    """CPU seconds a router's processes (its replicas, their Envoy, their Valkey) have used so far: a router's own
    CPU is part of its result on a machine it shares with the pods."""
    return sum(cpu_seconds(p.proc.pid) for p in procs if p.alive())


def _serve_config(path: str, logdir: Path) -> str:
    """`picker serve --config-file` wants the scheduler config under `scheduling:`."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if "scheduling" not in data:
        data = {"scheduling": data}
    out = logdir / "picker-scheduling.yaml"
    out.write_text(yaml.safe_dump(data))
    return str(out)


# --- the run -----------------------------------------------------------------------------------------------------
def pod_healthy(url: str) -> bool:
    """Whether the pod at `url` answers GET /health with 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def _wait_pods_ready(urls: list[str]) -> None:
    wait_until(lambda: all(pod_healthy(u) for u in urls), 30, "sim pods healthy")


async def _measure(strategy: str, url: str, spec: LiveSpec, trace: Any, urls: list[str], model: str,
                   bar: ProgressBar, during: Callable[[float], Coroutine[Any, Any, None]] | None = None) -> RunResult:
    """Replay `trace` through the router at `url`; `during(start)` (a fleet scenario's disruptions, given the
    run's start on the monotonic clock) runs alongside and is awaited after the replay."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await reset_caches(session, urls)
        before = await scrape(session, urls)
        stop = asyncio.Event()
        probe = RunResult("live", spec.workload, strategy, spec.pods, 0)
        start = time.monotonic()
        sampler = asyncio.create_task(sample_load(session, urls, probe, start, spec.time_scale, stop))
        scraping = peers.replicated(strategy)[0] in PICKER_STRATEGIES  # picker serve scrapes every pod itself
        load = None if scraping else asyncio.create_task(equal_scrape(session, urls, stop))
        tokenizer = Tokenizer(spec.get_profile().vocab_size)
        disrupting = asyncio.create_task(during(start)) if during is not None else None
        res = await replay(url, trace, strategy, pods=spec.pods, model=model, time_scale=spec.time_scale,
                           progress=bar.advance, builder=PromptBuilder(tokenizer),
                           oracle=InfiniteCacheOracle(spec.get_profile().block_size))
        stop.set()
        await sampler
        if disrupting is not None:
            await disrupting
        if load is not None:
            await load
        after = await scrape(session, urls)
    res.load_times, res.load_per_pod = probe.load_times, probe.load_per_pod
    for key in ("prefix_queries", "prefix_hits", "prompt_tokens_total", "prompt_tokens_cached", "generation_tokens",
                "preemptions"):
        setattr(res, key, int(sum(a[key] - b[key] for a, b in zip(after, before, strict=True))))
    return res


def run_live(spec: LiveSpec, out: Path) -> dict[str, Any]:
    """Run every router on one fleet; returns the live section of the report."""
    profile = spec.get_profile()
    fleet = FleetSpec(profile, spec.pods)
    cost = cost_per_request(spec.workload, fleet, spec.seed, spec.params)
    rate = rate_for_load(spec.load, spec.pods, cost)
    trace = generate(spec.workload, spec.requests, rate, spec.seed, fleet, **spec.params)
    section: dict[str, Any] = {
        "workload": spec.workload, "pods": spec.pods, "requests": spec.requests, "load": spec.load,
        "rate_rps": rate, "wall_rate_rps": rate * spec.time_scale, "time_scale": spec.time_scale,
        "profile": profile.name, "num_gpu_blocks": profile.num_gpu_blocks, "seed": spec.seed,
        "trace_params": trace.params, "times": "model seconds (wall seconds x time_scale)",
        "equal_scrape_load": "routers that do not scrape /metrics (Envoy round-robin, peers) run with a scrape of "
                             "every pod each second (the picker's calm cadence) added",
        "strategies": {}, "cdf": {}, "pod_load_series": {}, "skipped": {}, "notes": [], "router_cpu": {},
    }
    bar = ProgressBar(len(trace) * len(spec.order), "live mode")
    results: dict[str, RunResult] = {}
    try:
        with process_scope("bench-live") as (logdir, started):
            extra = ["--profile", profile.name, "--seed", str(spec.seed)]
            if spec.num_gpu_blocks:
                extra += ["--num-gpu-blocks", str(spec.num_gpu_blocks)]
            sim = start_sim(spec.pods, logdir, time_scale=spec.time_scale, extra=extra)
            started.append(sim.process)
            urls = [f"http://{a}" for a in sim.addresses]
            _wait_pods_ready(urls)
            section["worker_endpoints"] = peers.check_worker(urls[0])
            for strategy in spec.order:
                bar.set_label(f"live mode: {strategy}")
                try:
                    router = start_router(strategy, spec, sim.addresses, urls, logdir)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    section["skipped"][strategy] = str(exc)[:400]
                    bar.advance(len(trace))
                    continue
                started.extend(router.processes)
                try:
                    cpu, began = router_cpu(router.processes), time.monotonic()
                    results[strategy] = asyncio.run(_measure(strategy, router.url, spec, trace, urls, profile.model,
                                                             bar))
                    section["router_cpu"][strategy] = {"cpu_s": router_cpu(router.processes) - cpu,
                                                       "wall_s": time.monotonic() - began,
                                                       "processes": len(router.processes)}
                finally:
                    router.stop()
                    for p in router.processes:
                        started.remove(p)
    finally:
        bar.close()
    base = summarize(results["round-robin"]) if "round-robin" in results else None
    for strategy, res in results.items():
        figures = summarize(res)
        figures["ratio_to_round_robin"] = ratios_to(base, figures) if base else None
        section["strategies"][strategy] = figures
        values = ttft_sample(res, 100_000)
        section["cdf"][strategy] = [values[min(len(values) - 1, int(q / 100 * len(values)))]
                                    for q in range(101)] if values else []
        step = max(1, math.ceil(len(res.load_times) / 150))
        section["pod_load_series"][strategy] = {"t": res.load_times[::step], "per_pod": res.load_per_pod[::step]}
        section["notes"] += [f"{strategy}: {n}" for n in res.notes]
    (out / "live-raw.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "live-raw.json").write_text(json.dumps({"spec": spec.__dict__ | {"params": spec.params}}, default=str))
    return section
