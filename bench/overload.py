"""Overload, with and without flow control, side by side in one run: does flow control keep critical requests'
first tokens fast, refuse sheddable ones at once, share the pool fairly between tenants, and never let a request
hang in Envoy?

    .venv/bin/python bench/overload.py [--phase 60s] [--pods 2] [--out bench/out/overload]
    make overload

The stack: `picker sim` pods (llama3-8b-h100 profile, --max-num-seqs 4 so a pod queues early, time scale 0.5),
five `picker serve` (--pickers chooses): flow control on; flow control holding room back for critical requests
(standardCeiling 0.2); flow control holding a quarter, or half, of the pods' running slots for critical requests
(criticalSlotShare 0.25 / 0.5, capacity learned from the pods' metrics); the default admission (sheddable shed
when saturated, the rest routed); each behind its own Envoy (buffered ext_proc, message_timeout 5 s), on free 127.0.0.1 ports. The fleet's capacity
is measured first (a closed loop of 3 x max-num-seqs streams per pod), then for each picker in turn:
  - nominal: 0.5 x capacity, 20 % critical (objective priority 5), 50 % standard (0), 30 % sheddable (-1);
  - overload: 2 x capacity, the same mix;
  - tenants: 6.6 x capacity of standard requests from two fairness ids at 10:1 (6 x and 0.6 x: both above the
    half of the capacity a fair share gives each, so both stay backlogged).
Open-loop Poisson arrivals, streamed chat completions (TTFT = first token chunk at the client). Reported: TTFT
p50/p95 per priority, answer time of refusals (p50/p99) by status, statuses, requests that hung (no answer within
Envoy's route timeout) or timed out in Envoy (504 / reset), and for tenants the completions per tenant in the
window where both had requests waiting and their Jain fairness index. overload.json goes to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from picker.bench.workloads import WORDS  # noqa: E402
from picker.schema import parse_duration  # noqa: E402
from picker.supervisor import process_scope, start_envoy, start_picker, start_sim  # noqa: E402

OBJECTIVES = "admission:\n  objectives: [{name: critical, priority: 5}, {name: batch, priority: -1}]\n"
FLOW_CONFIG = OBJECTIVES + "  flowControl: {enabled: true}\n"
# standard and sheddable let through only while pods' queues hold under 1 on average: room held back for critical
HOLDBACK_CONFIG = OBJECTIVES + "  flowControl: {enabled: true, standardCeiling: 0.2}\n"
# a quarter (a half) of the pods' running slots, their capacity learned from the pods' metrics, kept for critical
SLOTS_CONFIG = OBJECTIVES + "  flowControl: {enabled: true, criticalSlotShare: 0.25}\n"
SLOTS_HALF_CONFIG = OBJECTIVES + "  flowControl: {enabled: true, criticalSlotShare: 0.5}\n"
PICKERS = (("flow-control", FLOW_CONFIG), ("flow-control-holdback", HOLDBACK_CONFIG),
           ("flow-control-slots", SLOTS_CONFIG), ("flow-control-slots-half", SLOTS_HALF_CONFIG),
           ("default-admission", OBJECTIVES))
MIX = (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))
PRIORITY_OBJECTIVE = {"critical": "critical", "standard": None, "sheddable": "batch"}
MAX_NUM_SEQS = 4
PROMPT_WORDS, MAX_TOKENS = 200, 96


@dataclass
class Shot:
    kind: str  # critical, standard, sheddable
    tenant: str
    sent: float
    status: int = 0
    first: float | None = None
    done: float | None = None
    reason: str = ""


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


async def one(session: aiohttp.ClientSession, url: str, shot: Shot, text: str) -> None:
    headers = {}
    objective = PRIORITY_OBJECTIVE[shot.kind]
    if objective:
        headers["x-gateway-inference-objective"] = objective
    if shot.tenant:
        headers["x-llm-d-inference-fairness-id"] = shot.tenant
    body = {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "stream": True, "max_tokens": MAX_TOKENS,
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


async def open_loop(url: str, rate: float, seconds: float, kinds: list[tuple[str, str, float]],
                    seed: int) -> list[Shot]:
    """Poisson arrivals at `rate` per second for `seconds`; each request's (kind, tenant) drawn by weight."""
    rng = random.Random(seed)
    shots: list[Shot] = []
    tasks = []
    timeout = aiohttp.ClientTimeout(total=620)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        at = start
        while at - start < seconds:
            at += rng.expovariate(rate)
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            kind, tenant = rng.choices([(k, t) for k, t, _ in kinds], weights=[w for _, _, w in kinds])[0]
            shot = Shot(kind, tenant, time.monotonic())
            shots.append(shot)
            tasks.append(asyncio.create_task(one(session, url, shot, prompt(rng))))
        await asyncio.gather(*tasks)
    return shots


async def capacity(url: str, pods: int, seconds: float) -> float:
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
        await asyncio.gather(*(worker(session) for _ in range(pods * MAX_NUM_SEQS * 3)))
        return done / (time.monotonic() - began)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(shots: list[Shot]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(shots), "statuses": dict(Counter(s.status for s in shots))}
    for kind in ("critical", "standard", "sheddable"):
        ttft = [s.first - s.sent for s in shots if s.kind == kind and s.status == 200 and s.first is not None]
        out[f"{kind}_ttft_p50_s"], out[f"{kind}_ttft_p95_s"] = pct(ttft, 0.5), pct(ttft, 0.95)
        out[f"{kind}_served"] = len(ttft)
    for status in (429, 503):
        answer = [s.done - s.sent for s in shots if s.status == status and s.done is not None]
        out[f"answer_{status}_p50_s"], out[f"answer_{status}_p99_s"] = pct(answer, 0.5), pct(answer, 0.99)
    out["hung_or_timed_out"] = sum(1 for s in shots if s.status in (-1, 504))
    out["reasons"] = dict(Counter(s.reason for s in shots if s.reason))
    return out


def fairness(shots: list[Shot]) -> dict[str, Any]:
    """Completions per tenant while both tenants had requests outstanding past their first second (backlogged)."""
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


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with process_scope("overload") as (logdir, started):
        sim = start_sim(args.pods, logdir, time_scale=0.5, extra=["--max-num-seqs", str(MAX_NUM_SEQS)])
        started.append(sim.process)
        results: dict[str, Any] = {"pods": args.pods, "phase_s": args.phase, "max_num_seqs": MAX_NUM_SEQS}
        for name, config in chosen(args):
            picker = start_picker(logdir, endpoints=sim.addresses, name=f"picker-{name}",
                                  extra=["--config-text", config])
            started.append(picker.process)
            envoy = start_envoy(logdir, picker, sim.addresses, name=f"envoy-{name}")
            started.append(envoy.process)
            url = envoy.url + "/v1/chat/completions"
            cap = results.setdefault("capacity_rps", await capacity(url, args.pods, args.calibrate))
            mix = [(k, "", w) for k, w in MIX]
            # 10:1, both above half the capacity (each backlogged: fair turns can only show when both wait)
            tenants = [("standard", "tenant-a", 10.0), ("standard", "tenant-b", 1.0)]
            phases = {}
            for seed, (phase_name, load, kinds) in enumerate((("nominal", 0.5, mix), ("overload", 2.0, mix),
                                                               ("tenants", 6.6, tenants))):
                print(f"{name}: {phase_name} at {load:g} x {cap:.1f} req/s for {args.phase:g} s", flush=True)
                shots = await open_loop(url, load * cap, args.phase, kinds, seed=seed)
                phases[phase_name] = summary(shots)
                if phase_name == "tenants":
                    phases[phase_name]["fairness"] = fairness(shots)
                await asyncio.sleep(3)  # drain
            results[name] = phases
            envoy.process.stop()
            picker.process.stop()
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", type=parse_duration, default=60.0, help="length of each phase (default 60s)")
    parser.add_argument("--calibrate", type=parse_duration, default=15.0, help="capacity measurement (default 15s)")
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "out" / "overload"))
    parser.add_argument("--pickers", default=",".join(name for name, _ in PICKERS),
                        help="comma-separated, from: %(default)s")
    args = parser.parse_args()
    unknown = set(args.pickers.split(",")) - {name for name, _ in PICKERS}
    if unknown:
        parser.error(f"--pickers: unknown {', '.join(sorted(unknown))}")
    results = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(results, indent=2))
    for name, _ in chosen(args):
        for phase, s in results[name].items():
            print(f"{name:18} {phase:9} statuses={s['statuses']} crit p95={_ms(s['critical_ttft_p95_s'])} "
                  f"std p95={_ms(s['standard_ttft_p95_s'])} 429 p99={_ms(s['answer_429_p99_s'])} "
                  f"hung={s['hung_or_timed_out']} {s.get('fairness', '')}")
    for name, _ in chosen(args):
        base = results[name]["nominal"]["critical_ttft_p95_s"]
        over = results[name]["overload"]["critical_ttft_p95_s"]
        if base and over:
            print(f"{name}: critical p95 at 2x / at 0.5x = {over / base:.2f} (target <= 1.5)")
    print(f"capacity {results['capacity_rps']:.2f} req/s")
    return 0


def chosen(args: argparse.Namespace) -> list[tuple[str, str]]:
    names = args.pickers.split(",")
    return [(name, config) for name, config in PICKERS if name in names]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}ms"


if __name__ == "__main__":
    sys.exit(main())
