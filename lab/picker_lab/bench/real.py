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
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from picker_lab.bench import peers
from picker_lab.bench import vllm_engine as engine
from picker_lab.bench.client import stream_request
from picker_lab.bench.live import read_counters
from picker_lab.bench.membership import PoolChange, write_pool
from picker_lab.bench.peers import PEERS, PeerPool
from picker_lab.bench.real_analysis import (
    cold_causes,
    is_cold,
    request_rows,
)
from picker_lab.bench.real_figures import medians, targets
from picker_lab.bench.real_routers import Router, picker_scrapes, start_router
from picker_lab.bench.real_spec import (
    REAL_WORKLOADS,
    SERVER_FLAGS,
    STRATEGIES,
    RealSpec,
    Request,
    build_trace,
    chains,
    tokens_per_word,
)
from picker_lab.bench.summary import percentile
from picker_lab.supervisor import (
    process_scope,
    wait_until,
)


# --- one run -------------------------------------------------------------------------------------------------------
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


