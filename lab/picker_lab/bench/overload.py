"""The overload scenario (`picker bench --scenario overload`, `make overload`): does flow control keep critical
requests' first tokens fast, refuse sheddable ones at once, share the pool fairly between tenants, and never let a
request hang?

The fleet: 2 pods of the llama3-8b-h100 profile with 8 sequences each (`--pods`, `--max-num-seqs`). The pickers,
each in turn on the same phases: flow control on; flow control holding room back for critical requests
(standardCeiling 0.2); flow control holding a quarter, or half, of the pods' running slots for critical requests
(criticalSlotShare 0.25 / 0.5, capacities learned from the pods' metrics); the half with the pods' capacity given
(maxRunningPerPod = their sequences); the default admission (sheddable shed when saturated, the rest routed). The
fleet's capacity is measured first (a saturating load), then each picker gets, in this order on the same fleet:
  - nominal: 0.5 x capacity, 20 % critical (objective priority 5), 50 % standard (0), 30 % sheddable (-1);
  - overload: 2 x capacity, the same mix;
  - tenants: 6.6 x capacity of standard requests from two fairness ids at 10:1 (6 x and 0.6 x: both above the
    half of the capacity a fair share gives each, so both stay backlogged).
Open-loop Poisson arrivals of chat requests (200-word prompts, 96 output tokens); both modes draw the same arrivals.

- live: `picker sim` pods (time scale 0.5: half speed keeps two cores ahead), each picker a `picker serve` behind
  its own Envoy (buffered ext_proc, message_timeout 5 s); capacity from a closed loop of 3 x max-num-seqs streams
  per pod; TTFT is the first streamed token chunk at the client. With `--replicas N` each picker is N replicas
  behind that Envoy sharing an index through a local Valkey, run twice: each replica counting only its own
  requests (`--shared-load-interval 0`), and sharing their load (the default).
- fast: the same pickers' flow control and admission (`picker_lab.bench.fast`) on simulated engines, on the live run's
  clock: the engines run at the same half speed (model seconds = 0.5 x reported seconds), so scrape cadence, queue
  TTL, phases and every reported time mean what they mean live. It has no Envoy, network or picker CPU, so a
  refusal takes no time.

Reported per picker and phase: TTFT p50/p95 per priority, answer time of refusals (p50/p99) by status, statuses,
requests that hung (no answer) or timed out in Envoy, and for tenants the completions per tenant in the window
where both had requests waiting and their Jain fairness index. overload.json and overload.md go to the output
directory.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import yaml

from picker.core.headers import FAIRNESS_ID
from picker.endpoints.scraper import Cadence
from picker.routing.admission import AdmissionConfig
from picker.serving.config import ServeConfig
from picker_lab.bench.capacity import saturating
from picker_lab.bench.fast import FastConfig, run_fast
from picker_lab.bench.results import OK, SHED
from picker_lab.bench.summary import nearest_rank
from picker_lab.bench.trace import Trace, TraceRequest
from picker_lab.bench.workloads import WORDS
from picker_lab.sim.profiles import get_profile

OBJECTIVES = "admission:\n  objectives: [{name: critical, priority: 5}, {name: batch, priority: -1}]\n"
FLOW_CONFIG = OBJECTIVES + "  flowControl: {enabled: true}\n"
# standard and sheddable let through only while pods' queues hold under 1 on average: room held back for critical
HOLDBACK_CONFIG = OBJECTIVES + "  flowControl: {enabled: true, standardCeiling: 0.2}\n"
# a quarter (a half) of the pods' running slots, their capacity learned from the pods' metrics, kept for critical
SLOTS_CONFIG = OBJECTIVES + "  flowControl: {enabled: true, criticalSlotShare: 0.25}\n"
SLOTS_HALF_CONFIG = OBJECTIVES + "  flowControl: {enabled: true, criticalSlotShare: 0.5}\n"
# the same with the pods' capacity given (their --max-num-seqs), not learned
SLOTS_HALF_KNOWN_CONFIG = OBJECTIVES + ("  flowControl: {enabled: true, criticalSlotShare: 0.5, "
                                        "maxRunningPerPod: MAX_NUM_SEQS}\n")
PICKERS = (("flow-control", FLOW_CONFIG), ("flow-control-holdback", HOLDBACK_CONFIG),
           ("flow-control-slots", SLOTS_CONFIG), ("flow-control-slots-half", SLOTS_HALF_CONFIG),
           ("flow-control-slots-half-known", SLOTS_HALF_KNOWN_CONFIG), ("default-admission", OBJECTIVES))
MIX = (("critical", "", 0.2), ("standard", "", 0.5), ("sheddable", "", 0.3))
# 10:1, both above half the capacity (each backlogged: fair turns can only show when both wait)
TENANTS = (("standard", "tenant-a", 10.0), ("standard", "tenant-b", 1.0))
PHASES = (("nominal", 0.5, MIX), ("overload", 2.0, MIX), ("tenants", 6.6, TENANTS))
PRIORITY_OBJECTIVE = {"critical": "critical", "standard": None, "sheddable": "batch"}
OBJECTIVE_KIND = {objective: kind for kind, objective in PRIORITY_OBJECTIVE.items()}
PROFILE = "llama3-8b-h100"
MAX_NUM_SEQS = 8
PROMPT_WORDS, MAX_TOKENS = 200, 96
TIME_SCALE = 0.5  # model seconds per reported second, in both modes
DRAIN_S = 3.0  # live: pause between phases
# replicas sharing load: picker serve's --shared-load-interval default
LOAD_SYNC_S: float = ServeConfig.model_fields["shared_load_interval"].default


@dataclass(frozen=True)
class OverloadSpec:
    pods: int = 2
    phase_s: float = 60.0
    calibrate_s: float = 15.0  # live: the closed loop that measures capacity
    pickers: tuple[str, ...] = tuple(name for name, _ in PICKERS)
    seed: int = 0
    repeats: int = 10  # fast: seeds run (the first one's figures in full, the spread of all)
    max_num_seqs: int = MAX_NUM_SEQS  # each pod's batch (vLLM --max-num-seqs)
    # Picker replicas behind Envoy (sharing an index through Valkey live); more than one runs each picker twice:
    # each replica counting only its own requests, and the replicas sharing their in-flight counts.
    replicas: int = 1

    def chosen(self) -> list[Contender]:
        unknown = set(self.pickers) - {name for name, _ in PICKERS}
        if unknown:
            raise ValueError(f"unknown overload picker(s) {', '.join(sorted(unknown))}; choose from "
                             f"{', '.join(name for name, _ in PICKERS)}")
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        fleets = [("", 0.0)] if self.replicas == 1 else [
            (f", {self.replicas} replicas, own counts", 0.0), (f", {self.replicas} replicas, shared load", LOAD_SYNC_S)]
        return [Contender(name + suffix, config.replace("MAX_NUM_SEQS", str(self.max_num_seqs)), self.replicas, sync)
                for name, config in PICKERS if name in self.pickers for suffix, sync in fleets]


class Contender(NamedTuple):
    """One picker of the scenario as it runs: its name in the report, its config, its replicas and how often they
    share their in-flight counts (0: never)."""

    name: str
    config: str
    replicas: int = 1
    load_sync_s: float = 0.0


@dataclass
class Shot:
    """One request as its client saw it (times in seconds; status -1: no answer)."""

    kind: str  # critical, standard, sheddable
    tenant: str
    sent: float
    status: int = 0
    first: float | None = None
    done: float | None = None
    reason: str = ""


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


def arrivals(rate: float, seconds: float, kinds: Sequence[tuple[str, str, float]],
             seed: int) -> Iterator[tuple[float, str, str, str]]:
    """Poisson arrivals at `rate` per second for `seconds`: (time, kind, tenant, prompt), kind and tenant drawn
    by weight."""
    rng = random.Random(seed)
    at = 0.0
    while at < seconds:
        at += rng.expovariate(rate)
        kind, tenant = rng.choices([(k, t) for k, t, _ in kinds], weights=[w for _, _, w in kinds])[0]
        yield at, kind, tenant, prompt(rng)


def summary(shots: list[Shot]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(shots), "statuses": dict(Counter(s.status for s in shots))}
    for kind in ("critical", "standard", "sheddable"):
        ttft = [s.first - s.sent for s in shots if s.kind == kind and s.status == 200 and s.first is not None]
        out[f"{kind}_ttft_p50_s"], out[f"{kind}_ttft_p95_s"] = nearest_rank(ttft, 0.5), nearest_rank(ttft, 0.95)
        out[f"{kind}_served"] = len(ttft)
    for status in (429, 503):
        answer = [s.done - s.sent for s in shots if s.status == status and s.done is not None]
        out[f"answer_{status}_p50_s"], out[f"answer_{status}_p99_s"] = nearest_rank(answer, 0.5), nearest_rank(answer, 0.99)
    out["hung_or_timed_out"] = sum(1 for s in shots if s.status in (-1, 504))
    out["reasons"] = dict(Counter(s.reason for s in shots if s.reason))
    return out


def fairness(shots: list[Shot]) -> dict[str, Any]:
    """Completions per tenant while both tenants had requests outstanding past their first seconds (backlogged)."""
    tenants = sorted({s.tenant for s in shots})
    begin = min(s.sent for s in shots) + 5.0
    end = max(s.sent for s in shots) - 2.0
    served = {t: sum(1 for s in shots if s.tenant == t and s.status == 200 and s.done is not None
                     and begin <= s.done <= end) for t in tenants}
    values: list[int] = list(served.values())
    most = max(values, default=0)
    jain = sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if most else None
    ratio = min(values) / most if most else None
    return {"window_s": [0.0, round(end - begin, 1)], "served": served, "ratio": ratio, "jain": jain}


def phase_result(shots: list[Shot], phase: str) -> dict[str, Any]:
    out = summary(shots)
    if phase == "tenants":
        out["fairness"] = fairness(shots)
    return out


def admission_section(config_text: str) -> AdmissionConfig:
    """The `admission:` section of a picker config, as `picker serve` decodes it."""
    return AdmissionConfig.from_dict(yaml.safe_load(config_text)["admission"])


# --- fast mode --------------------------------------------------------------------------------------------------

def fast_trace(rate: float, seconds: float, kinds: Sequence[tuple[str, str, float]], seed: int, *,
               start: float = 0.0, before: tuple[TraceRequest, ...] = ()) -> Trace:
    """The phase's arrivals in model time (rate, duration and `start` in reported seconds), after the requests
    of the phases `before` it."""
    requests = tuple(
        TraceRequest(len(before) + i, (start + at) * TIME_SCALE, MAX_TOKENS, messages=(("user", text),),
                     objective=PRIORITY_OBJECTIVE[kind], tenant=tenant or None)
        for i, (at, kind, tenant, text) in enumerate(arrivals(rate, seconds, kinds, seed)))
    return Trace("overload", seed, rate / TIME_SCALE, before + requests)


def fast_config(pods: int, admission: AdmissionConfig | None, seed: int,
                max_num_seqs: int = MAX_NUM_SEQS, replicas: int = 1, load_sync_s: float = 0.0,
                max_num_batched_tokens: int | None = None) -> FastConfig:
    """The live fleet in simulated time: its pods, picker serve's adaptive scrape cadence and the queue TTL in
    model seconds; several replicas share an index and scrapes, and their load every `load_sync_s` (0: never);
    `max_num_batched_tokens`: the pods' prefill chunk, if not the profile's."""
    profile = get_profile(PROFILE).with_overrides(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens)
    if admission is not None:
        flow = admission.flow_control.model_copy(update={"queue_ttl": admission.flow_control.queue_ttl * TIME_SCALE})
        admission = admission.model_copy(update={"flow_control": flow})
    default = Cadence()
    cadence = Cadence(fast=default.fast * TIME_SCALE, slow=default.slow * TIME_SCALE,
                      compare_in_flight=replicas == 1)  # as picker serve's with a shared index
    return FastConfig(profile, pods, seed=seed, cadence=cadence, admission_config=admission, replicas=replicas,
                      shared_index=replicas > 1, load_sync_interval=load_sync_s * TIME_SCALE)


def fast_capacity(pods: int, seed: int, requests: int = 400, max_num_seqs: int = MAX_NUM_SEQS) -> float:
    """Completions per reported second of the fleet when every request is there at once (round-robin)."""
    trace = saturating(fast_trace(1.0, max(requests, 25 * pods * max_num_seqs), MIX, seed))
    res = run_fast(trace, "round-robin", fast_config(pods, None, seed, max_num_seqs))
    served = sum(1 for s in res.status if s == OK)
    return served / (res.duration_s / TIME_SCALE)


def fast_shots(trace: Trace, strategy_config: str, pods: int, seed: int,
               max_num_seqs: int = MAX_NUM_SEQS, replicas: int = 1, load_sync_s: float = 0.0,
               max_num_batched_tokens: int | None = None) -> list[Shot]:
    res = run_fast(trace, "picker", fast_config(pods, admission_section(strategy_config), seed, max_num_seqs,
                                                replicas, load_sync_s, max_num_batched_tokens))
    shots = []
    for r in trace.requests:
        i = r.index
        sent, e2e, ttft = res.sent[i], res.e2e[i], res.ttft[i]
        status = 200 if res.status[i] == OK else 429 if res.status[i] == SHED else 503 if not math.isnan(e2e) else -1
        shots.append(Shot(OBJECTIVE_KIND[r.objective], r.tenant or "", sent / TIME_SCALE, status,
                          (sent + ttft) / TIME_SCALE if not math.isnan(ttft) else None,
                          (sent + e2e) / TIME_SCALE if not math.isnan(e2e) else None))
    return shots


def run_fast_overload(spec: OverloadSpec) -> dict[str, Any]:
    """The first seed's figures, and under "seeds" each picker's key figures for every seed."""
    runs = [fast_overload_once(spec, spec.seed + k) for k in range(max(1, spec.repeats))]
    results = runs[0]
    results["seeds"] = {name: {"seed": [spec.seed + k for k in range(len(runs))],
                               "critical_ratio": [critical_ratio(r[name]) for r in runs],
                               "served_at_2x": [served_at_2x(r[name]) for r in runs],
                               "jain": [r[name]["tenants"]["fairness"]["jain"] for r in runs],
                               "answer_429_p99_s": [r[name]["overload"]["answer_429_p99_s"] for r in runs],
                               "hung_or_timed_out": [sum(p["hung_or_timed_out"] for p in r[name].values())
                                                     for r in runs]}
                        for name, *_ in spec.chosen()}
    return results


def fast_overload_once(spec: OverloadSpec, seed: int) -> dict[str, Any]:
    cap = fast_capacity(spec.pods, seed, max_num_seqs=spec.max_num_seqs)
    results: dict[str, Any] = {"seed": seed, "pods": spec.pods, "phase_s": spec.phase_s,
                               "max_num_seqs": spec.max_num_seqs, "capacity_rps": cap}
    for contender in spec.chosen():
        results[contender.name] = fast_phases(spec, contender, cap, seed)
    return results


def fast_phases(spec: OverloadSpec, contender: Contender, cap: float, seed: int) -> dict[str, Any]:
    """The phases one after another on one fleet and one picker, as the live run has them (what the picker
    learned in one phase, pods' capacities included, carries into the next): a phase begins DRAIN_S after the
    last answer of the one before, found by replaying the phases so far (each replay repeats the last exactly)."""
    requests: tuple[TraceRequest, ...] = ()
    spans: list[tuple[str, int, int]] = []
    start = 0.0
    shots: list[Shot] = []
    for n, (phase, load, kinds) in enumerate(PHASES):
        trace = fast_trace(load * cap, spec.phase_s, kinds, seed + n, start=start, before=requests)
        spans.append((phase, len(requests), len(trace.requests)))
        requests = trace.requests
        shots = fast_shots(trace, contender.config, spec.pods, seed, spec.max_num_seqs, contender.replicas,
                           contender.load_sync_s)
        start = max(s.done or s.sent for s in shots) + DRAIN_S
    return {phase: phase_result(shots[first:end], phase) for phase, first, end in spans}


def critical_ratio(phases: dict[str, Any]) -> float | None:
    """Critical TTFT p95 at 2x over its p95 at nominal load (the issue's target: <= 1.5)."""
    base, over = phases["nominal"]["critical_ttft_p95_s"], phases["overload"]["critical_ttft_p95_s"]
    return over / base if base and over else None


def served_at_2x(phases: dict[str, Any]) -> int:
    return int(phases["overload"]["critical_served"] + phases["overload"]["standard_served"])


# --- live mode --------------------------------------------------------------------------------------------------

async def one(session: aiohttp.ClientSession, url: str, shot: Shot, text: str, max_tokens: int = MAX_TOKENS) -> None:
    headers = {}
    objective = PRIORITY_OBJECTIVE[shot.kind]
    if objective:
        headers["x-gateway-inference-objective"] = objective
    if shot.tenant:
        headers[FAIRNESS_ID] = shot.tenant
    body = {"model": get_profile(PROFILE).model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}
    try:
        async with session.post(url, json=body, headers=headers) as response:
            shot.status = response.status
            shot.reason = response.headers.get("x-llm-d-request-dropped-reason", "")
            async for line in response.content:
                data = line.strip()[5:].strip() if line.startswith(b"data:") else b""
                if shot.first is None and data and data != b"[DONE]" and json.loads(data).get("choices"):
                    shot.first = time.monotonic()  # the first token chunk
    except (TimeoutError, aiohttp.ClientError) as exc:
        shot.status, shot.reason = -1, type(exc).__name__
    shot.done = time.monotonic()


async def open_loop(url: str, rate: float, seconds: float, kinds: Sequence[tuple[str, str, float]],
                    seed: int) -> list[Shot]:
    shots: list[Shot] = []
    tasks = []
    timeout = aiohttp.ClientTimeout(total=620)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        for at, kind, tenant, text in arrivals(rate, seconds, kinds, seed):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            shot = Shot(kind, tenant, time.monotonic())
            shots.append(shot)
            tasks.append(asyncio.create_task(one(session, url, shot, text)))
        await asyncio.gather(*tasks)
    return shots


async def live_capacity(url: str, slots: int, seconds: float) -> float:
    """Completions per second of a closed loop that keeps every pod's batch full and a queue behind it."""
    rng = random.Random(0)
    done = 0
    stop = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            shot = Shot("critical", "", time.monotonic())
            await one(session, url, shot, prompt(rng))
            done += shot.status == 200
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        began = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(slots * 3)))
        return done / (time.monotonic() - began)


async def run_live_overload(spec: OverloadSpec) -> dict[str, Any]:
    from picker_lab.supervisor import process_scope, start_picker_fleet, start_sim, start_valkey

    with process_scope("overload") as (logdir, started):
        sim = start_sim(spec.pods, logdir, time_scale=TIME_SCALE, extra=["--max-num-seqs", str(spec.max_num_seqs)])
        started.append(sim.process)
        shared: list[str] = []
        if spec.replicas > 1:  # the replicas share an index, scrapes and (or not) their load through Valkey
            valkey = start_valkey(logdir)
            started.append(valkey.process)
            shared = ["--index-backend", "redis", "--redis-url", valkey.url]
        results: dict[str, Any] = {"pods": spec.pods, "phase_s": spec.phase_s, "max_num_seqs": spec.max_num_seqs,
                                   "replicas": spec.replicas}
        for k, c in enumerate(spec.chosen()):
            flags = ["--config-text", c.config]
            if shared:
                flags += [*shared, "--index-namespace", f"overload-{k}", "--shared-load-interval", f"{c.load_sync_s}s"]
            fleet = start_picker_fleet(logdir, sim.addresses, flags=flags, replicas=c.replicas, name=f"picker-{k}",
                                       first_host=10 + 10 * k)
            started.extend(fleet.processes)
            url = fleet.envoy.url + "/v1/chat/completions"
            cap = results.setdefault("capacity_rps", await live_capacity(url, spec.pods * spec.max_num_seqs,
                                                                         spec.calibrate_s))
            phases = {}
            for n, (phase, load, kinds) in enumerate(PHASES):
                print(f"overload live: {c.name}: {phase} at {load:g} x {cap:.1f} req/s for {spec.phase_s:g} s",
                      flush=True)
                phases[phase] = phase_result(await open_loop(url, load * cap, spec.phase_s, kinds, spec.seed + n),
                                             phase)
                await asyncio.sleep(DRAIN_S)
            results[c.name] = phases
            for process in reversed(fleet.processes):
                process.stop()
        return results


# --- both -------------------------------------------------------------------------------------------------------

def run_overload(spec: OverloadSpec, modes: Sequence[str], out: Path) -> dict[str, Any]:
    """Run the scenario in `modes` (fast, live), write overload.json and overload.md to `out`."""
    spec.chosen()
    results: dict[str, Any] = {}
    for mode in modes:
        results[mode] = run_fast_overload(spec) if mode == "fast" else asyncio.run(run_live_overload(spec))
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(results, indent=2))
    (out / "overload.md").write_text(report(spec, results))
    return results


def report(spec: OverloadSpec, results: dict[str, Any]) -> str:
    lines = ["# Overload", ""]
    for mode, r in results.items():
        lines += [f"## {mode}: capacity {r['capacity_rps']:.2f} req/s, {spec.pods} pods x {spec.max_num_seqs} sequences, "
                  f"{spec.phase_s:g} s phases", "",
                  "| picker | phase | critical TTFT p95 | standard TTFT p95 | 429 answered p99 | statuses | hung |",
                  "|---|---|---|---|---|---|---|"]
        for name, *_ in spec.chosen():
            for phase, s in r[name].items():
                statuses = ", ".join(f"{n} x {code}" for code, n in sorted(s["statuses"].items(), key=lambda x: str(x)))
                lines.append(f"| {name} | {phase} | {_ms(s['critical_ttft_p95_s'])} | {_ms(s['standard_ttft_p95_s'])} "
                             f"| {_ms(s['answer_429_p99_s'])} | {statuses} | {s['hung_or_timed_out']} |")
        lines += ["", "| picker | critical p95 at 2x / nominal (target <= 1.5) | served at 2x | tenants served | "
                  "ratio | Jain |", "|---|---:|---:|---|---:|---:|"]
        for name, *_ in spec.chosen():
            ratio = critical_ratio(r[name])
            f = r[name]["tenants"]["fairness"]
            lines.append(f"| {name} | {_num(ratio, 'x')} | {served_at_2x(r[name])} | "
                         f"{' : '.join(str(v) for v in f['served'].values())} | {_num(f['ratio'])} | {_num(f['jain'])} |")
        lines.append("")
        if "seeds" in r:
            seeds = r["seeds"]
            lines += [f"Over {len(next(iter(seeds.values()))['seed'])} seeds, median (range):", "",
                      "| picker | critical p95 at 2x / nominal | served at 2x | Jain | 429 answered p99 | hung |",
                      "|---|---:|---:|---:|---:|---:|"]
            for name, *_ in spec.chosen():
                x = seeds[name]
                lines.append(f"| {name} | {_spread(x['critical_ratio'], 'x')} | {_spread(x['served_at_2x'], '', 0)} | "
                             f"{_spread(x['jain'], '', 3)} | {_spread([v * 1e3 for v in x['answer_429_p99_s'] if v is not None], ' ms', 0)} | "
                             f"{sum(x['hung_or_timed_out'])} |")
            lines.append("")
    return "\n".join(lines)


def _spread(values: Sequence[float | None], unit: str = "", digits: int = 2) -> str:
    known = sorted(v for v in values if v is not None)
    if not known:
        return "-"
    return f"{statistics.median(known):.{digits}f}{unit} ({known[0]:.{digits}f}-{known[-1]:.{digits}f})"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _num(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{unit}" if not unit else f"{value:.2f}{unit}"
