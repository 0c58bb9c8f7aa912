"""`picker bench --engine vllm` (`make bench-real`): routers compared on real vLLM CPU servers, not the simulator.

Each (strategy, repeat) gets fresh servers: N real vLLM servers (bench/.venvs/vllm, a small random-weight Llama
built locally, prefix caching, `block_size` x `num_blocks` of KV cache each, engine i bound to core i), the router
in front, a short warm-up sent to every server directly, then the same open-loop trace through Envoy. The model
(vllm_engine.SMALL) is sized so that a cold prefill costs ~4x a cached request's TTFT, as on a GPU-served 8B
model; with the tiny validate-sim model a cache hit saves ~10 ms of ~28 and no router could show much. On a machine
fast enough that SMALL's engines idle at a workload's rate, `model="medium"` (`--model-shape medium`, ~12x the
compute per token) brings the engines back to the loaded regime the rates were chosen for.

- workloads (`--workload`, one per run; REAL_WORKLOADS): inference-perf's `shared_prefix` shape, `groups` system
  prompts of `system_tokens` tokens, `prompts_per_group` questions of `question_tokens` each, `output_tokens` out,
  Poisson arrivals at `rate` req/s in a seeded random order: `uniform` (20 groups, the prefixes fit the fleet's
  caches, not one server's), `pressure` (24 groups: their prefixes just fit both caches together) and `hot` (4
  groups, one carrying over half the traffic, at a rate one server cannot carry alone, every prefix fits every
  server) and `multi-turn` (conversations whose growing contexts are sent again every turn, sized so the live
  ones fit the caches);
- routers: `round-robin` (Envoy alone), the hash baselines a user tries first, reading no metrics (`hash-ring`:
  the first 1,000 prompt characters on a consistent-hash ring, 200 points per pod; `bounded-load`: that ring with
  bounded loads, c = 1.25; `prefix-hash`: a rendezvous hash of the same characters), `picker` (`picker serve`
  defaults), `picker-predicted-ttft` (PREDICTED_TTFT_CONFIG: the pod with the least predicted time to first
  token), `picker-4-replicas` (four replicas behind one Envoy sharing a Valkey index: does the pods' scrape
  load grow?) and `picker-round-robin` (`picker serve --strategy round-robin`: the picker's path, its ext_proc
  round trips, scrapes and CPU, with round-robin's decisions: what routing through the picker costs, apart from
  where it sends requests) and `picker-candidate` (the picker with `--candidate-args` on top of `--picker-args`,
  say a config file that changes one default: the change measured beside the defaults in one run); the peers `sglang-router` and `vllm-router` (`cache_aware`, each in its own venv,
  lab/picker_lab/bench/peers.py) run as the proxies they are, the client sending to them and they to the same servers
  (no Envoy: their requests are not attributed to a pod, so the per-pod sections of the report leave them out;
  in `leave-rejoin` the pool change reaches them through their own add/remove-worker API).

Measured: hit rate from vLLM's own counters (prefix_cache_hits / prefix_cache_queries), TTFT from the client,
request share from vllm:request_success_total, the servers' CPU (API server and engine processes, /proc) and the
/metrics requests each pod served per second (the pickers' own scrape counters). Writes real.json, real.md and
real-ttft.png; medians over repeats are what the report compares.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import math
import os
import random
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.bench import peers
from picker_lab.bench import vllm_engine as engine
from picker_lab.bench.client import SERVED_BY_HEADER, stream_request
from picker_lab.bench.live import predicted_ttft_config, read_counters, start_direct_envoy
from picker_lab.bench.membership import PoolChange, write_pool
from picker_lab.bench.peers import PEERS, PeerPool
from picker_lab.bench.real_analysis import (
    HASH_BASELINES,
    cold_causes,
    held_medians,
    is_cold,
    request_rows,
)
from picker_lab.bench.summary import percentile
from picker_lab.bench.workloads import group_sizes
from picker_lab.sim.server import NAMED_SCRAPE_SHARE
from picker_lab.supervisor import (
    HOST,
    Managed,
    cpu_seconds,
    process_scope,
    start_picker_fleet,
    start_valkey,
    wait_until,
)

STRATEGIES = ("round-robin", "hash-ring", "bounded-load", "prefix-hash", "picker", "picker-predicted-ttft",
              "picker-4-replicas", "picker-round-robin", "picker-candidate", *PEERS)
# What `make bench-real` compares: round-robin, the two strong hash baselines and the defaults.
DEFAULT_STRATEGIES = ("round-robin", "hash-ring", "bounded-load", "picker")
# What the hash baselines read: nothing but liveness, so its scrapes are kept to a health check.
HEALTH_ONLY_INTERVAL = "5s"
# vLLM 0.32 answers its render endpoints (prompt -> token ids, what vllm-router's cache_aware policy routes on) with
# 403 unless started with this; it adds routes, nothing on the request path of the other routers.
SERVER_FLAGS = ["--enable-scale-out"]
# API-server CPU one /metrics scrape costs vLLM 0.32 on the CPU (bench/scrape_cost.py: 6.7-6.8 ms idle, 4.2-7.7 ms
# under traffic), for the simulator's mirror of this benchmark.
SCRAPE_COST_S = 0.006


# Each workload's shape, as RealSpec fields; what is not named takes RealSpec's default (`uniform`). A KV block
# holds 64 tokens: a 768-token prefix is 12 blocks, 160 blocks per server.
REAL_WORKLOADS: dict[str, dict[str, Any]] = {
    # 20 prefixes = 240 blocks: the fleet's caches hold them all, one server's does not
    "uniform": {},
    # 24 prefixes = 288 of the fleet's 320 blocks: they fit only if no prefix is held twice. Every miss is a cold
    # 768-token prefill (4.1 s on the 2026-12-03 machine): 2 req/s overloaded both servers (hash ring 19 s mean), 1
    # req/s keeps them busy but not past saturation
    "pressure": {"groups": 24, "prompts_per_group": 10, "rate": 1.0},
    # 4 prefixes (48 blocks) that every server holds easily, one of them carrying over half the traffic, at a rate
    # one server cannot carry alone: with Envoy, router and client sharing their two cores, the two servers here
    # were saturated at 2.4 req/s (round-robin p90 3.6 s), so one carries at most ~1.2
    "hot": {"groups": 4, "prompts_per_group": 60, "group_weights": (0.55, 0.25, 0.1, 0.1), "rate": 1.7},
    # 30 conversations of 6 turns, each growing to ~1,100 tokens (17 blocks), a 3 s pause between an answer and the
    # next turn: ~6 live at a time, whose contexts fit the caches
    "multi-turn": {"groups": 30, "turns": 6, "system_tokens": 512, "question_tokens": 64, "output_tokens": 32,
                   "think_s": 3.0, "rate": 1.2},
    # 12 prefixes (144 blocks: one server holds them all) at a rate one server carries alone (the hot workload's
    # limit is ~1.2 req/s); the second server leaves at 30 % of the run and a fresh one (empty cache, a new address)
    # joins at 60 %: a rolling restart (lab/picker_lab/bench/membership.py). Round-robin's Envoy has a static cluster that
    # cannot follow the change; the pickers read an endpoints file, the peers get their add/remove-worker calls.
    "leave-rejoin": {"groups": 12, "prompts_per_group": 17, "rate": 1.0, "leave_at": 0.3, "rejoin_at": 0.6,
                     "strategies": ("hash-ring", "bounded-load", "picker")},
}


@dataclass(frozen=True)
class RealSpec:
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    workload: str = "uniform"
    repeats: int = 3
    servers: int = 2
    groups: int = 20
    prompts_per_group: int = 12
    system_tokens: int = 768
    question_tokens: int = 64
    output_tokens: int = 16
    rate: float = 2.0
    group_weights: tuple[float, ...] = ()  # popularity per group (same total); empty: all alike
    turns: int = 0  # > 0: `groups` conversations of this many turns instead of shared prefixes
    think_s: float = 1.0  # conversations: mean pause between an answer and the next turn
    block_size: int = 64
    num_blocks: int = 160
    seed: int = 1
    picker_args: tuple[str, ...] = ()  # extra `picker serve` flags for the picker strategies
    candidate_args: tuple[str, ...] = ()  # and for `picker-candidate` only, after those
    model: str = "small"  # the served model's shape: vllm_engine.MODEL_SHAPES
    leave_at: float = 0.0  # > 0: the last server leaves at this share of the trace's span ...
    rejoin_at: float = 0.0  # ... and a fresh server joins at this one
    # True: one set of servers for every run, their prefix caches emptied between runs (vLLM's reset endpoint)
    # instead of fresh servers: ~3x the runs in the same time, every router on the same processes
    reuse_servers: bool = False
    # True: repeat r replays the trace of seed + r. Fresh servers listen on new ports, so the hash routers throw
    # their placement dice anew each repeat; reused ones keep their ports, and one trace would measure a hash on
    # one placement of its prefixes however many repeats ran (set with reuse_servers by `picker bench`)
    seed_per_repeat: bool = False
    # True: the routers behind our Envoy asked vLLM for only the series they read (`--metrics-only-read-series`,
    # every run since 2026-12-06), so the mirror prices their scrapes at NAMED_SCRAPE_SHARE of a whole page's;
    # a run recorded without the key scraped whole pages (`recorded`)
    series_filter: bool = True

    @property
    def scrape_cost_s(self) -> float:
        """API-server CPU one of this run's scrapes cost a pod, as the mirror prices it."""
        return SCRAPE_COST_S * (NAMED_SCRAPE_SHARE if self.series_filter else 1.0)

    def trace_seed(self, repeat: int) -> int:
        """The seed of repeat `repeat`'s trace (0-based; settling passes, numbered below 0, replay repeat 0's)."""
        return self.seed + max(repeat, 0) if self.seed_per_repeat else self.seed

    @property
    def requests(self) -> int:
        return self.groups * (self.turns or self.prompts_per_group)

    @classmethod
    def for_workload(cls, workload: str, **given: Any) -> RealSpec:
        """The spec of a named workload (REAL_WORKLOADS), `given` fields on top."""
        if workload not in REAL_WORKLOADS:
            raise ValueError(f"unknown workload {workload!r} for --engine vllm (known: {', '.join(REAL_WORKLOADS)})")
        return cls(workload=workload, **{**REAL_WORKLOADS[workload], **given})

    def with_requests(self, requests: int) -> RealSpec:
        """The same workload with about `requests` requests: more prompts per shared prefix at the same popularity,
        so a faster machine can be loaded at a higher rate for as long as a slower one at the preset's."""
        if self.turns:
            raise ValueError(f"--requests: the {self.workload} workload is {self.groups} conversations of "
                             f"{self.turns} turns; scale it with --rate")
        if requests < self.groups:
            raise ValueError(f"--requests: at least one per group ({self.groups})")
        return replace(self, prompts_per_group=round(requests / self.groups))

    @classmethod
    def recorded(cls, spec: dict[str, Any]) -> RealSpec:
        """The spec as a run's real.json holds it (lists back to tuples, derived keys such as `requests` dropped)."""
        names = {f.name for f in fields(cls)}
        given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k in names}
        return cls(**{"series_filter": False, **given})  # recorded before the filter: whole pages


# --- the workload -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One request. A conversation's later turns (`turn` > 0) are sent `at` seconds after the previous turn's
    answer, their prompt appended to the conversation so far (its prompts and answers); the rest `at` seconds
    after the start."""

    at: float
    group: int  # the shared prefix's group, or the conversation
    prompt: str
    turn: int = 0


def build_trace(spec: RealSpec, tokens_per_word: float, repeat: int = 0) -> list[Request]:
    """Shared-prefix prompts in a seeded random order with Poisson arrivals, or conversations (`turns` > 0); the
    seed is repeat `repeat`'s (RealSpec.trace_seed)."""
    rng = random.Random(spec.trace_seed(repeat))
    words = engine.vocabulary()

    def text(tokens: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, round(tokens / tokens_per_word))))

    if spec.turns:
        return conversations(spec, text, rng)
    systems = [text(spec.system_tokens) for _ in range(spec.groups)]
    sizes = group_sizes(spec.groups, spec.prompts_per_group, spec.group_weights)
    pairs = [(g, text(spec.question_tokens)) for g in range(spec.groups) for _ in range(sizes[g])]
    rng.shuffle(pairs)
    at = 0.0
    out = []
    for g, question in pairs:
        at += rng.expovariate(spec.rate)
        out.append(Request(at, g, f"{systems[g]}\n\nQuestion: {question}\nAnswer:"))
    return out


def tokens_per_word(url: str) -> float:
    """Calibrate word counts to token counts with the server's own tokenizer (/tokenize)."""
    rng = random.Random(99)
    words = engine.vocabulary()
    sample = " ".join(rng.choice(words) for _ in range(2000))
    body = json.dumps({"model": engine.MODEL_NAME, "prompt": sample, "add_special_tokens": False}).encode()
    req = urllib.request.Request(url + "/tokenize", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return float(json.load(resp)["count"]) / 2000


# --- the servers' own counters -------------------------------------------------------------------------------------
def picker_scrapes(metrics_port: int, host: str = HOST) -> dict[str, float]:
    """Scrapes one picker replica made, per pod address (its /metrics)."""
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=10) as resp:
        return scrapes_per_pod(resp.read().decode())


def scrapes_per_pod(text: str) -> dict[str, float]:
    """picker_model_server_scrapes_total of a picker's exposition, per pod, ok and failed together."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "picker_model_server_scrapes_total":
                pod = sample.labels["model_server_pod"]
                out[pod] = out.get(pod, 0.0) + sample.value
    return out


# --- routers -------------------------------------------------------------------------------------------------------
@dataclass
class Router:
    url: str
    processes: list[Managed]
    metrics_ports: list[tuple[str, int]] = field(default_factory=list)  # (host, port) of each picker replica
    # Behind our Envoy: it times each request and names the pod that served it (a peer router is neither)
    through_envoy: bool = True

    def cpu_seconds(self) -> float:
        """User + system CPU time of the router's processes so far."""
        return sum(cpu_seconds(p.proc.pid) for p in self.processes if p.alive())


def picker_flags(strategy: str, spec: RealSpec, logdir: Path) -> list[str]:
    """The `picker serve` flags of a strategy served by the picker (the hash baselines included)."""
    if strategy in HASH_BASELINES:
        flags = ["--strategy", strategy, "--refresh-metrics-interval", HEALTH_ONLY_INTERVAL]
    elif strategy in ("picker", "picker-4-replicas"):
        flags = list(spec.picker_args)
    elif strategy == "picker-predicted-ttft":
        flags = [*spec.picker_args, "--config-file", str(predicted_ttft_config(logdir, 1.0))]
    elif strategy == "picker-round-robin":
        flags = ["--strategy", "round-robin"]  # scraping at the picker's default cadence, as `picker` does
    elif strategy == "picker-candidate":
        flags = [*spec.picker_args, *spec.candidate_args]
    else:
        raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    return ["--log-level", "WARNING", *flags]  # first, so `--picker-args "--log-level DEBUG"` overrides it


def start_router(strategy: str, spec: RealSpec, pool: list[str], logdir: Path,
                 endpoints_file: Path | None = None, timing_log: Path | None = None) -> Router:
    """The router in front of `pool`; the picker strategies follow `endpoints_file` when given. Its Envoy writes
    what it added to each request to `timing_log` (envoyconfig.add_timing_log) when given. `NAME@N` is N replicas
    behind one load balancer (peers.replicated): the picker's behind its Envoy sharing a Valkey, a peer's behind
    an Envoy round-robin (whose timing and pod attribution would be the router's, so it is a peer's as for one)."""
    name, replicas, mesh = peers.replicated(strategy)
    if name == "round-robin":
        direct, url = start_direct_envoy(logdir, pool, served_by=SERVED_BY_HEADER, timing_log=timing_log)
        return Router(url, [direct])
    if name in PEERS:
        started, urls = peers.start_replicas(PEERS[name], [f"http://{address}" for address in pool], logdir,
                                             replicas, mesh)
        if replicas == 1:
            return Router(urls[0], started, through_envoy=False)
        try:
            front, url = start_direct_envoy(logdir, [u.removeprefix("http://") for u in urls],
                                            name=f"envoy-{strategy.replace('@', '-')}")
        except BaseException:
            for proc in started:
                proc.stop()
            raise
        return Router(url, [*started, front], through_envoy=False)
    flags = picker_flags(name, spec, logdir)
    if name == "picker-4-replicas":
        replicas = 4
    procs: list[Managed] = []
    if replicas > 1 and name not in HASH_BASELINES:  # they share their index and load, as deployed
        valkey = start_valkey(logdir, name=f"valkey-{name}")
        procs.append(valkey.process)
        flags += ["--index-backend", "redis", "--redis-url", valkey.url]
    try:
        fleet = start_picker_fleet(logdir, pool, flags=flags, replicas=replicas, name=f"picker-{name}",
                                   served_by=SERVED_BY_HEADER, endpoints_file=endpoints_file,
                                   timing_log=timing_log)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return Router(fleet.envoy.url, [*procs, *fleet.processes], [(p.host, p.metrics_port) for p in fleet.pickers])


# --- one run -------------------------------------------------------------------------------------------------------
def conversations(spec: RealSpec, text: Callable[[int], str], rng: random.Random) -> list[Request]:
    """`groups` conversations of `turns` turns, starting with Poisson arrivals at `rate / turns` (about `rate`
    requests/s in all): a first message of `system_tokens` of its own, then `question_tokens` per turn, each sent
    an exponential think time (mean `think_s`) after the previous answer. Sized so the live conversations'
    contexts fit the caches: a working set larger than them defeats every router."""
    out: list[Request] = []
    start = 0.0
    for c in range(spec.groups):
        start += rng.expovariate(spec.rate / spec.turns)
        out.append(Request(start, c, f"{text(spec.system_tokens)}\n\nUser: {text(spec.question_tokens)}\nAssistant:"))
        out += [Request(rng.expovariate(1.0 / spec.think_s), c, f"\n\nUser: {text(spec.question_tokens)}\nAssistant:",
                        turn) for turn in range(1, spec.turns)]
    return out


def chains(trace: list[Request]) -> list[list[Request]]:
    """The trace as sequences sent one after another: a conversation's turns, or one request alone."""
    out: list[list[Request]] = []
    for r in trace:
        if r.turn:
            out[-1].append(r)
        else:
            out.append([r])
    return out


async def replay(url: str, trace: list[Request], spec: RealSpec) -> list[dict[str, Any]]:
    """Send every request at its time (a later turn: after the previous answer), streamed; returns the client's
    record of each."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        start = time.monotonic()

        async def send(prompt: str, group: int) -> dict[str, Any]:
            # Special tokens stay visible, so their chunks carry text like every other token's.
            body = {"model": engine.MODEL_NAME, "prompt": prompt, "max_tokens": spec.output_tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True, "skip_special_tokens": False,
                    "stream_options": {"include_usage": True}}
            got = await stream_request(session, url + "/v1/completions", body, {})
            got["group"] = group
            return got

        async def converse(turns: list[Request]) -> list[dict[str, Any]]:
            await asyncio.sleep(max(0.0, start + turns[0].at - time.monotonic()))
            records: list[dict[str, Any]] = []
            context = ""
            for r in turns:
                if r.turn:
                    await asyncio.sleep(r.at)
                got = await send(context + r.prompt, r.group)
                context += r.prompt + "".join(got.pop("text", None) or ())
                records.append(got)
                if got.get("status") != 200:
                    break  # the conversation cannot go on without its answer
            return records

        done = await asyncio.gather(*(converse(c) for c in chains(trace)))
        return [record for records in done for record in records]


def warm_up(servers: list[engine.VllmServer], spec: RealSpec, tokens_per_word: float) -> None:
    """Three full-size requests per server, sent directly with text no trace prompt shares: first-request costs
    (allocations, kernels seen for the first time at this size) stay out of the measurement."""
    rng = random.Random(12345)
    words = engine.vocabulary()
    n_words = round((spec.system_tokens + spec.question_tokens) / tokens_per_word)
    for server in servers:
        for _ in range(3):
            prompt = " ".join(rng.choice(words) for _ in range(n_words))
            body = json.dumps({"model": engine.MODEL_NAME, "prompt": prompt, "max_tokens": spec.output_tokens,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()


def start_servers(spec: RealSpec, logdir: Path, tag: str) -> list[engine.VllmServer]:
    """The run's servers, each engine on its own core, healthy. With `leave_at` one more is started (on the
    leaving one's core), to join the pool when that one has left (PoolChange)."""
    spare = 1 if spec.leave_at else 0
    servers: list[engine.VllmServer] = []
    try:
        for i in range(spec.servers + spare):
            servers.append(engine.start_server(logdir, block_size=spec.block_size, num_blocks=spec.num_blocks,
                                               name=f"vllm-{tag}-{i}", cpu=min(i, spec.servers - 1) % _cpus(),
                                               model_dir=engine.MODEL_SHAPES[spec.model].directory,
                                               resettable=spec.reuse_servers, extra=SERVER_FLAGS))
        for s in servers:
            s.wait_healthy()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


SETTLE_PASSES = 4  # at most this many unmeasured passes of the trace before the first measured run
SETTLE_CHANGE = 0.1  # ... stopping once a pass's mean TTFT is within this share of the previous pass's


def settle(spec: RealSpec, trace_fn: Any, logdir: Path, servers: list[engine.VllmServer]) -> list[float]:
    """Replay the trace through round-robin, not measured, until its mean TTFT settles: servers' first
    minutes under load were 1.2-2x slower for every router (bench/studies/real-pinned-servers.md, "Servers pinned to their cores"), and
    with --reuse-servers only the first runs would pay it. Returns each pass's mean TTFT."""
    means: list[float] = []
    for n in range(SETTLE_PASSES):
        result = run_once("round-robin", spec, trace_fn, -1 - n, logdir, servers)
        means.append(result.get("ttft_mean_ms", math.nan))
        engine.log(f"settling pass {n + 1} (round-robin, not measured): TTFT mean {means[-1]:.1f} ms")
        if len(means) > 1 and abs(means[-1] - means[-2]) <= SETTLE_CHANGE * means[-2]:
            break
    return means


def run_once(strategy: str, spec: RealSpec, trace_fn: Any, repeat: int, logdir: Path,
             shared: list[engine.VllmServer] | None = None) -> dict[str, Any]:
    """One router, the trace, on fresh servers or on `shared` ones with their prefix caches emptied (warmed up
    once when started); the figures of this run."""
    servers = shared if shared is not None else start_servers(spec, logdir, f"{strategy}-{repeat}")
    router: Router | None = None
    change: PoolChange | None = None
    cancel = threading.Event()
    mover: threading.Thread | None = None
    try:
        trace, tokens_per_word = trace_fn(servers[0].url, repeat)
        if shared is None:
            warm_up(servers, spec, tokens_per_word)
        else:
            for s in servers:
                s.reset_prefix_cache()
        pool = [s.address for s in servers[: spec.servers]]
        endpoints = logdir / f"endpoints-{strategy}-{repeat}.yaml" if spec.leave_at else None
        if endpoints is not None:
            write_pool(endpoints, pool)
        timing = logdir / f"timing-{strategy}-{repeat}.log"
        router = start_router(strategy, spec, pool, logdir, endpoints, timing)
        if endpoints is not None:
            span = trace[-1].at
            gone = servers[spec.servers - 1]
            publish = (PeerPool(PEERS[strategy], router.url, pool) if strategy in PEERS
                       else functools.partial(write_pool, endpoints))
            change = PoolChange(publish, list(servers[: spec.servers - 1]), gone, servers[-1],
                                spec.leave_at * span, spec.rejoin_at * span,
                                lambda: (read_counters(gone.url), engine.group_cpu_seconds(gone.proc.pid)))
        before = [read_counters(s.url) for s in servers]
        cpu_before = [engine.group_cpu_seconds(s.proc.pid) for s in servers]
        scrapes_before = [picker_scrapes(p, h) for h, p in router.metrics_ports]
        router_cpu = router.cpu_seconds()
        wall = time.monotonic()
        if change is not None:
            mover = threading.Thread(target=change.run, args=(wall, cancel), name="pool-change", daemon=True)
            mover.start()
        records = asyncio.run(replay(router.url, trace, spec))
        wall = time.monotonic() - wall
        cancel.set()
        if mover is not None:
            mover.join()
        after, cpu_after = [], []
        for s in servers:  # the server that left was read just before it stopped
            left = change is not None and change.last is not None and s is change.leaving
            counters, cpu = change.last if left and change is not None else (
                read_counters(s.url), engine.group_cpu_seconds(s.proc.pid))
            after.append(counters)
            cpu_after.append(cpu)
        scrapes_after = [picker_scrapes(p, h) for h, p in router.metrics_ports]
        router_cpu = router.cpu_seconds() - router_cpu
        held = routing_delays(timing, len(records)) if router.through_envoy else None
    finally:
        cancel.set()
        if router is not None:
            for proc in reversed(router.processes):
                proc.stop()
        if shared is None:
            for s in servers:
                s.stop()
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    api_cpu = [ca.get(s.proc.pid, 0.0) - cb.get(s.proc.pid, 0.0) for s, ca, cb in zip(servers, cpu_after, cpu_before,
                                                                                       strict=True)]
    all_cpu = [sum(ca.values()) - sum(cb.get(k, 0.0) for k in ca) for ca, cb in zip(cpu_after, cpu_before,
                                                                                    strict=True)]
    scrapes_per_pod = {s.address: sum(a.get(s.address, 0.0) - b.get(s.address, 0.0)
                                      for a, b in zip(scrapes_after, scrapes_before, strict=True)) / wall
                       for s in servers}
    # TTFT: the first streamed chunk with a choice. Random weights sometimes pick byte tokens that decode to no
    # text yet, but the token came back all the same.
    ok = [r for r in records if r.get("status") == 200 and r.get("first_chunk") is not None]
    rows = request_rows(ok, [s.address for s in servers])
    ttft = np.array([row[5] for row in rows])
    warm = np.array([not is_cold(row[3], row[4]) for row in rows], dtype=bool)
    cached = sum(row[4] for row in rows)
    prompt = sum(row[3] for row in rows)
    served = [d["requests"] for d in delta]
    queries = sum(d["prefix_queries"] for d in delta)
    failures = collections.Counter(f"{r.get('status')} {r.get('error', '')}".strip()[:160]
                                   for r in records if r.get("status") != 200 or r.get("first_chunk") is None)
    return {
        "strategy": strategy, "repeat": repeat, "requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "failures": dict(failures.most_common(3)),
        "hit_rate": sum(d["prefix_hits"] for d in delta) / queries if queries else math.nan,
        "usage_cached_share": cached / prompt if prompt else math.nan,
        "mean_prompt_tokens": prompt / len(ok) if ok else math.nan,
        "ttft_mean_ms": float(ttft.mean()) if ttft.size else math.nan,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90), "ttft_p99_ms": percentile(ttft, 99),
        # what a cache hit is worth on these servers: TTFT of requests served mostly from cache vs mostly cold
        "warm_share": float(warm.mean()) if warm.size else math.nan,
        "ttft_warm_p50_ms": percentile(ttft[warm], 50), "ttft_cold_p50_ms": percentile(ttft[~warm], 50),
        "share": [s / sum(served) if sum(served) else math.nan for s in served],
        "api_server_cpu_share": [c / wall for c in api_cpu],
        "server_cpu_share": [c / wall for c in all_cpu],
        "metrics_requests_per_pod_per_s": list(scrapes_per_pod.values()),
        # the router's processes (Envoy, picker replicas, Valkey) share the machine's cores with the engines here
        "router_cpu_share": router_cpu / wall,
        # what the router held each request for, in Envoy's own clock (p50, p90 ms): before the pod got it, and
        # between the pod's response and the client's
        **({"request_held_ms": [percentile(held[0], 50), percentile(held[0], 90)],
            "response_held_ms": [percentile(held[1], 50), percentile(held[1], 90)]} if held is not None else {}),
        "wall_s": wall,
        **({"pool_changes": change.events} if change is not None else {}),
        # one row per answered request, in send order: what a reader needs to see where the cold prefills were
        "requests_detail": rows,
        # which pod served each: only a router behind our Envoy says (the per-pod sections need it)
        "pods_known": router.through_envoy,
        **({"cold_causes": cold_causes(rows),
            "groups_per_pod": [len({row[1] for row in rows if row[2] == i}) for i in range(len(servers))]}
           if router.through_envoy else {}),
    }


def routing_delays(path: Path, expected: int, timeout: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """Milliseconds Envoy held each request before the pod and each response before the client, from its timing
    log (envoyconfig.TIMING_FORMAT). Envoy writes the log on a timer: it is read once it holds `expected` lines,
    or as it is after `timeout` seconds. A field Envoy could not time ("-": the request never reached a pod) is
    left out."""
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: len(path.read_text().splitlines()) >= expected, timeout, "Envoy's timing log")
    request, response = [], []
    for line in (path.read_text().splitlines() if path.exists() else []):
        fields = line.split()
        if len(fields) == 2:
            if fields[0].isdigit():
                request.append(int(fields[0]) / 1000)
            if fields[1].isdigit():
                response.append(int(fields[1]) / 1000)
    return np.array(request, dtype=float), np.array(response, dtype=float)


DETAIL_COLUMNS = ("sent_s", "group", "pod", "prompt_tokens", "cached_tokens", "ttft_ms")
TTFT_COLUMN = DETAIL_COLUMNS.index("ttft_ms")


def report_json(section: dict[str, Any]) -> str:
    """real.json: the report indented, each run on one line (its per-request rows would be thousands of lines)."""
    head = json.dumps({k: v for k, v in section.items() if k != "runs"}, indent=1, default=str)
    runs = ",\n  ".join(json.dumps(r, default=str) for r in section.get("runs", []))
    return f'{head[:-2]},\n "runs": [\n  {runs}\n ]\n}}\n' if head != "{}" else f'{{"runs": [{runs}]}}\n'



def _cpus() -> int:
    return len(os.sched_getaffinity(0)) or 1


# --- the whole benchmark --------------------------------------------------------------------------------------------
def run_real(spec: RealSpec, out: Path) -> dict[str, Any]:
    if spec.workload not in REAL_WORKLOADS:
        raise ValueError(f"unknown workload {spec.workload!r} for --engine vllm (known: {', '.join(REAL_WORKLOADS)})")
    for s in spec.strategies:
        try:
            name, replicas, _ = peers.replicated(s)
        except ValueError as exc:
            raise ValueError(f"--strategies {exc}") from None
        if name not in STRATEGIES or (replicas > 1 and name in ("picker-4-replicas", "round-robin")):
            raise ValueError(f"unknown strategy {s!r} for --engine vllm (known: {', '.join(STRATEGIES)}, each "
                             "also as NAME@N: N replicas behind one load balancer)")
        if spec.leave_at and replicas > 1 and name in PEERS:
            raise ValueError(f"{s}: a pool change reaches one peer process through its API; replicated peers are "
                             "not measured with a pod leaving")
    if ("picker-candidate" in spec.strategies) != bool(spec.candidate_args):
        raise ValueError("--candidate-args and the picker-candidate strategy go together (the candidate is the "
                         "picker with those flags)")
    if spec.leave_at:
        if not 0 < spec.leave_at < spec.rejoin_at < 1 or spec.servers < 2:
            raise ValueError("a pod leaving needs 0 < leave_at < rejoin_at < 1 and at least two servers")
        if "round-robin" in spec.strategies:
            raise ValueError(f"workload {spec.workload}: round-robin's Envoy routes over a static list of servers and "
                             "cannot follow a pod leaving (pick the routers that follow the pool)")
    if spec.reuse_servers and spec.leave_at:
        raise ValueError(f"workload {spec.workload}: a pod leaving stops its server, so its runs need fresh servers "
                         "(drop --reuse-servers)")
    if spec.model not in engine.MODEL_SHAPES:
        raise ValueError(f"unknown model shape {spec.model!r} (known: {', '.join(engine.MODEL_SHAPES)})")
    engine.install()
    engine.build_model(engine.MODEL_SHAPES[spec.model])
    calibration: dict[str, float] = {}

    def trace_fn(url: str, repeat: int) -> tuple[list[Request], float]:
        if "tokens_per_word" not in calibration:
            calibration["tokens_per_word"] = tokens_per_word(url)
        return build_trace(spec, calibration["tokens_per_word"], repeat), calibration["tokens_per_word"]

    runs: list[dict[str, Any]] = []
    # SIGTERM unwinds like Ctrl-C, so every server and router started so far is stopped on the way out.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.ExitStack() as restore, process_scope("bench-real") as (logdir, _started):
        restore.callback(signal.signal, signal.SIGTERM, previous)
        shared: list[engine.VllmServer] | None = None
        settling: list[float] = []
        if spec.reuse_servers:
            shared = start_servers(spec, logdir, "shared")
            for server in shared:
                restore.callback(server.stop)
            warm_up(shared, spec, trace_fn(shared[0].url, 0)[1])
            settling = settle(spec, trace_fn, logdir, shared)
        for repeat in range(spec.repeats):
            order = list(spec.strategies) if repeat % 2 == 0 else list(reversed(spec.strategies))
            for strategy in order:
                engine.log(f"repeat {repeat + 1}/{spec.repeats}: {strategy}")
                try:
                    result = run_once(strategy, spec, trace_fn, repeat, logdir, shared)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    result = {"strategy": strategy, "repeat": repeat, "error": str(exc)[:400]}
                engine.log(f"  {json.dumps(result, default=str)}")
                runs.append(result)
    summary = medians(runs, spec.strategies)
    section: dict[str, Any] = {"spec": asdict(spec) | {"requests": spec.requests}, "calibration": calibration,
                               "runs": runs, "medians": summary, "targets": targets(summary, spec.workload),
                               **({"settling_ttft_ms": settling} if settling else {})}
    from picker_lab.bench.real_mirror import mirror  # it reads this module's spec and targets

    mirror(section, spec)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real.json").write_text(report_json(section))
    from picker_lab.bench.real_render import plot, report  # it reads this module's spec and constants

    (out / "real.md").write_text(report(section))
    plot(section, out / "real-ttft.png")
    return section


def combine(sections: list[dict[str, Any]], drop: tuple[int, ...] = (), why: str = "") -> dict[str, Any]:
    """One report's section from the runs of several of the same workload (their repeats numbered on in order),
    less the repeats in `drop` (1-based, after numbering; e.g. one the machine was disturbed in, said in `why`):
    medians and targets computed again, the dropped runs kept aside. The simulator's mirror is left out (re-run it
    with `mirror`)."""
    if not sections:
        raise ValueError("nothing to combine")
    first = RealSpec.recorded(sections[0]["spec"])
    runs: list[dict[str, Any]] = []
    for section in sections:
        spec = RealSpec.recorded(section["spec"])
        if replace(spec, strategies=first.strategies, repeats=first.repeats) != first:
            raise ValueError(f"runs of different workloads cannot be combined: {asdict(spec)} vs {asdict(first)}")
        offset = 1 + max((r["repeat"] for r in runs), default=-1)
        runs += [{**r, "repeat": r["repeat"] + offset} for r in section["runs"]]
    kept = [r for r in runs if r["repeat"] + 1 not in drop]
    strategies = tuple(dict.fromkeys(r["strategy"] for r in runs))
    spec = replace(first, strategies=strategies, repeats=len({r["repeat"] for r in kept}))
    summary = medians(kept, strategies)
    return {"spec": asdict(spec) | {"requests": spec.requests}, "calibration": sections[0]["calibration"],
            "runs": kept, "medians": summary, "targets": targets(summary, spec.workload),
            "dropped": {"repeats": sorted(drop), "why": why, "runs": [r for r in runs if r["repeat"] + 1 in drop]}}


_FIGURES = ("hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "failed", "warm_share",
            "ttft_warm_p50_ms", "ttft_cold_p50_ms")


def medians(runs: list[dict[str, Any]], strategies: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for s in strategies:
        mine = [r for r in runs if r["strategy"] == s and "error" not in r]
        if not mine:
            continue
        row: dict[str, Any] = {k: statistics.median(r[k] for r in mine) for k in _FIGURES}
        row["runs"] = len(mine)
        for figure in ("ttft_mean_ms", "ttft_p90_ms", "hit_rate"):
            row[f"{figure}_range"] = [min(r[figure] for r in mine), max(r[figure] for r in mine)]
        row["max_share"] = statistics.median(max(r["share"]) for r in mine)
        row["server_cpu_share"] = statistics.median(sum(r["server_cpu_share"]) / len(r["server_cpu_share"])
                                                    for r in mine)
        row["api_server_cpu_share"] = statistics.median(
            sum(r["api_server_cpu_share"]) / len(r["api_server_cpu_share"]) for r in mine)
        row["metrics_requests_per_pod_per_s"] = statistics.median(
            max(r["metrics_requests_per_pod_per_s"] or [0.0]) for r in mine)
        measured = [r["router_cpu_share"] for r in mine if "router_cpu_share" in r]  # runs since 2026-12-05
        row["router_cpu_share"] = statistics.median(measured) if measured else math.nan
        row.update(held_medians(mine))
        out[s] = row
    return out


# Per workload, what the picker is held to against the better hash baseline (figure by figure): at most `factor`
# times its TTFT figures, at least its hit rate (factor unused). Hot prefixes are where hashing fails; every router
# is warm there, so hit rates are not compared.
HASH_TARGETS: dict[str, dict[str, float]] = {
    "uniform": {"ttft_mean_ms": 1.0, "ttft_p90_ms": 1.0, "hit_rate": 1.0},
    "pressure": {"ttft_mean_ms": 1.0, "ttft_p90_ms": 1.0, "hit_rate": 1.0},
    "hot": {"ttft_mean_ms": 0.85, "ttft_p90_ms": 0.85},
    "multi-turn": {"ttft_p90_ms": 0.85},
    "leave-rejoin": {"ttft_p90_ms": 0.85},
}
_FIGURE_LABELS = {"ttft_mean_ms": "TTFT mean", "ttft_p90_ms": "TTFT p90", "hit_rate": "hit rate"}


def targets(m: dict[str, dict[str, Any]], workload: str = "uniform") -> list[dict[str, Any]]:
    """The workload's acceptance figures against the better of the hash baselines (the lower median, figure by
    figure) and round-robin, each with what was measured. Noise is what the report's ranges show."""
    out: list[dict[str, Any]] = []

    def add(name: str, met: bool, measured: str) -> None:
        out.append({"target": name, "met": bool(met), "measured": measured})

    pk, rr = m.get("picker"), m.get("round-robin")
    hashes = {name: m[name] for name in HASH_BASELINES if name in m}
    bounds = HASH_TARGETS.get(workload, HASH_TARGETS["uniform"])
    if pk and hashes:
        for figure, factor in bounds.items():
            label = _FIGURE_LABELS[figure]
            if figure == "hit_rate":
                best = max(hashes, key=lambda name: hashes[name][figure])
                add(f"picker {label} >= the better hash baseline's", pk[figure] >= hashes[best][figure],
                    f"{pk[figure]:.3f} vs {best} {hashes[best][figure]:.3f}")
                continue
            best = min(hashes, key=lambda name: hashes[name][figure])
            add(f"picker {label} <= {factor:g}x the better hash baseline's", pk[figure] <= factor * hashes[best][figure],
                f"{pk[figure]:.1f} vs {best} {hashes[best][figure]:.1f} ms ({pk[figure] / hashes[best][figure]:.2f}x)")
    if pk and rr and workload == "hot":
        for figure in ("ttft_mean_ms", "ttft_p90_ms"):
            add(f"picker {_FIGURE_LABELS[figure]} <= round-robin's", pk[figure] <= rr[figure],
                f"{pk[figure]:.1f} vs {rr[figure]:.1f} ms ({pk[figure] / rr[figure]:.2f}x)")
    pt, ph = m.get("picker-predicted-ttft"), m.get("prefix-hash")
    if pt and ph:
        add("predicted-ttft picker TTFT mean < prefix-hash's", pt["ttft_mean_ms"] < ph["ttft_mean_ms"],
            f"{pt['ttft_mean_ms']:.1f} vs {ph['ttft_mean_ms']:.1f} ms")
    p4 = m.get("picker-4-replicas")
    if pk and p4:
        # 5 %: a run's scrape count over its wall time jitters by a scrape or two
        add("/metrics requests per pod per s at 4 replicas <= at 1 replica (within 5 %)",
            p4["metrics_requests_per_pod_per_s"] <= pk["metrics_requests_per_pod_per_s"] * 1.05,
            f"{p4['metrics_requests_per_pod_per_s']:.2f} vs {pk['metrics_requests_per_pod_per_s']:.2f}")
    return out
