"""Fairness by tokens against fairness by requests under a heavy tenant (`picker bench --scenario token-fairness`,
`make token-fairness`): do three light tenants keep their first tokens fast while a fourth sends ten times their
tokens and the pool is offered twice what it can serve?

Two `llama3-8b-h100` pods with 64 sequences each (time scale 0.5), each picker a `picker serve` with flow control
behind its own Envoy. Four tenants (`x-llm-d-inference-fairness-id`) at equal request rates: three light ones
(100-word prompts, 32 output tokens) and a heavy one (1,000 words, 320 tokens: ten times the prompt and the output
of each light request). The fleet's capacity for that mix is measured first (a closed loop keeping every pod's
batch full), then each picker gets, on the same pods:
  - unloaded: the light tenants' requests alone (the loaded phase's arrivals without the heavy tenant's);
  - loaded: all four tenants at 2 x the capacity.
Pickers: flow control sharing turns by requests (`fairness: requests`, the default), by tokens (`fairness:
tokens`), and by tokens with requests waiting in the picker for a free running slot instead of in the pods'
first-come queues (`criticalSlotShare` 0.02 with the pods' capacity given: a standard request goes only to a pod
with a free slot); and, as a bound no fairness rule can beat, the light tenants' requests critical with a tenth
of the running slots kept free for them (what they still lose under load is the pods' batch, not the order). By
turns, a round lets one request of each waiting tenant through, so the heavy tenant takes ten thirteenths of the
pods and the light ones, each offered two thirteenths, are backlogged; by tokens each tenant is owed a quarter. Reported per picker: the light tenants' TTFT p90 loaded over unloaded (the target:
<= 1.5x with token fairness), the share of their requests served, and the heavy tenant's. `--repeats` seeds, the
pickers' order reversed every other seed; medians and ranges.

- live: real processes (`picker sim` pods, `picker serve`, Envoy); TTFT is the first streamed token chunk.
- fast: the same flow controller on the simulated engines (`picker_lab.bench.fast`), on the live run's clock:
  seconds per seed, no picker CPU or network.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from picker_lab.bench.capacity import saturating
from picker_lab.bench.fast import run_fast
from picker_lab.bench.overload import (
    DRAIN_S,
    PRIORITY_OBJECTIVE,
    TIME_SCALE,
    Shot,
    fast_config,
    fast_shots,
    one,
)
from picker_lab.bench.results import OK
from picker_lab.bench.summary import nearest_rank
from picker_lab.bench.trace import Trace, TraceRequest
from picker_lab.bench.workloads import WORDS

LIGHT_TENANTS = ("light-1", "light-2", "light-3")
# Not a fairness rule but what none can beat: the light tenants' requests critical, a tenth of the running slots
# kept free for them. What the light tenants lose under load beyond it is the pods' batch, not the order.
BOUND = "bound: light critical, slots kept"
OBJECTIVES = "  objectives: [{name: critical, priority: 5}]\n"
HEAVY_TENANT = "heavy"
# (prompt words, output tokens): the heavy tenant's requests are ten times the light ones' in both
SIZES = {"light": (100, 32), "heavy": (1000, 320)}
# name -> flow control settings ({seqs}: the pods' --max-num-seqs)
PICKERS = {"requests": "fairness: requests", "tokens": "fairness: tokens",
           "tokens, slots": "fairness: tokens, criticalSlotShare: 0.02, maxRunningPerPod: {seqs}",
           BOUND: "fairness: tokens, criticalSlotShare: {kept}, maxRunningPerPod: {seqs}"}


def picker_config(name: str, max_num_seqs: int, kept_slot_share: float = 0.1) -> str:
    settings = PICKERS[name].format(seqs=max_num_seqs, kept=kept_slot_share)
    return f"admission:\n{OBJECTIVES}  flowControl: {{enabled: true, {settings}}}\n"


def kind_of(tenant: str, picker: str) -> str:
    """The light tenants' requests are critical for the bound, standard otherwise."""
    return "critical" if picker == BOUND and tenant != HEAVY_TENANT else "standard"


@dataclass(frozen=True)
class TokenFairnessSpec:
    pods: int = 2
    max_num_seqs: int = 64
    # What else was tried against the bound: more of the slots kept for the light tenants, and the pods' prefill
    # chunk (vLLM's --max-num-batched-tokens; None: the profile's 8,192).
    kept_slot_share: float = 0.1
    max_num_batched_tokens: int | None = None
    phase_s: float = 40.0  # wall seconds of arrivals per phase
    calibrate_s: float = 15.0
    load: float = 2.0  # the loaded phase's offered load, times the fleet's capacity for the mix
    seed: int = 0
    repeats: int = 3


def size_of(tenant: str) -> tuple[int, int]:
    return SIZES["heavy" if tenant == HEAVY_TENANT else "light"]


def arrivals(rate: float, seconds: float, seed: int) -> Iterator[tuple[float, str, str]]:
    """Poisson arrivals at `rate` per second over all four tenants, equally likely: (time, tenant, prompt)."""
    rng = random.Random(seed)
    tenants = (*LIGHT_TENANTS, HEAVY_TENANT)
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return
        tenant = rng.choice(tenants)
        words, _ = size_of(tenant)
        yield at, tenant, " ".join(rng.choice(WORDS) for _ in range(words))


async def open_loop(url: str, rate: float, seconds: float, seed: int, with_heavy: bool, picker: str) -> list[Shot]:
    """Send the phase's arrivals (without the heavy tenant's when not `with_heavy`) and wait for every answer."""
    shots: list[Shot] = []
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=620),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        for at, tenant, text in arrivals(rate, seconds, seed):
            if tenant == HEAVY_TENANT and not with_heavy:
                continue
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            shot = Shot(kind_of(tenant, picker), tenant, time.monotonic())
            shots.append(shot)
            tasks.append(asyncio.create_task(one(session, url, shot, text, max_tokens=size_of(tenant)[1])))
        await asyncio.gather(*tasks)
    return shots


async def mix_capacity(url: str, slots: int, seconds: float, seed: int) -> float:
    """Completions per second of the four tenants' mix in a closed loop keeping every batch full with a queue."""
    rng = random.Random(seed)
    done = 0
    stop = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            tenant = rng.choice((*LIGHT_TENANTS, HEAVY_TENANT))
            words, max_tokens = size_of(tenant)
            shot = Shot("standard", "", time.monotonic())  # no fairness id: the loop measures the pods, not turns
            await one(session, url, shot, " ".join(rng.choice(WORDS) for _ in range(words)), max_tokens=max_tokens)
            done += shot.status == 200
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        began = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(slots * 3)))
        return done / (time.monotonic() - began)


def phase_figures(shots: list[Shot]) -> dict[str, Any]:
    return {"light": tenants_figures(shots, LIGHT_TENANTS), "heavy": tenants_figures(shots, (HEAVY_TENANT,))}


def with_ratio(phases: dict[str, Any]) -> dict[str, Any]:
    """The phases, and the light tenants' TTFT p90 loaded over unloaded."""
    unloaded, loaded = phases["unloaded"]["light"]["ttft_p90_s"], phases["loaded"]["light"]["ttft_p90_s"]
    return {**phases, "light_p90_ratio": loaded / unloaded if unloaded and loaded else None}


def tenants_figures(shots: list[Shot], tenants: tuple[str, ...]) -> dict[str, Any]:
    """TTFT p50 / p90 (model seconds) of the tenants' served requests, and the share of theirs served."""
    mine = [s for s in shots if s.tenant in tenants]
    ttft = [(s.first - s.sent) * TIME_SCALE for s in mine if s.status == 200 and s.first is not None]
    return {"sent": len(mine), "served": len(ttft), "served_share": len(ttft) / len(mine) if mine else None,
            "ttft_p50_s": nearest_rank(ttft, 0.5), "ttft_p90_s": nearest_rank(ttft, 0.9),
            "statuses": {str(k): v for k, v in sorted(Counter(s.status for s in mine).items())}}


async def one_seed(spec: TokenFairnessSpec, seed: int, order: tuple[str, ...]) -> dict[str, Any]:
    from picker_lab.supervisor import process_scope, start_picker_fleet, start_sim

    with process_scope("token-fairness") as (logdir, started):
        chunk = ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)] if spec.max_num_batched_tokens else []
        sim = start_sim(spec.pods, logdir, time_scale=TIME_SCALE,
                        extra=["--max-num-seqs", str(spec.max_num_seqs), *chunk])
        started.append(sim.process)
        result: dict[str, Any] = {"seed": seed}
        for k, name in enumerate(order):
            fleet = start_picker_fleet(logdir, sim.addresses, name=f"picker-{k}", first_host=10 + 10 * k,
                                       flags=["--config-text", picker_config(name, spec.max_num_seqs,
                                                                             spec.kept_slot_share)])
            started.extend(fleet.processes)
            url = fleet.envoy.url + "/v1/chat/completions"
            if "capacity_rps" not in result:
                result["capacity_rps"] = await mix_capacity(url, spec.pods * spec.max_num_seqs, spec.calibrate_s, seed)
            rate = spec.load * result["capacity_rps"]
            phases: dict[str, Any] = {}
            for phase, with_heavy in (("unloaded", False), ("loaded", True)):
                print(f"token-fairness seed {seed}: {name}: {phase} ({rate:.1f} req/s offered over the four "
                      f"tenants{'' if with_heavy else ', the light ones sent'})", flush=True)
                phases[phase] = phase_figures(await open_loop(url, rate, spec.phase_s, seed, with_heavy, name))
                await asyncio.sleep(DRAIN_S)
            result[name] = with_ratio(phases)
            for process in reversed(fleet.processes):
                process.stop()
                started.remove(process)
        return result


# --- fast mode --------------------------------------------------------------------------------------------------

def fast_trace(rate: float, seconds: float, seed: int, with_heavy: bool, picker: str = "") -> Trace:
    """The phase's arrivals in model time (`rate` and `seconds` on the reported clock), as sent to `picker`."""
    requests: list[TraceRequest] = []
    for at, tenant, text in arrivals(rate, seconds, seed):
        if tenant != HEAVY_TENANT or with_heavy:
            requests.append(TraceRequest(len(requests), at * TIME_SCALE, size_of(tenant)[1],
                                         messages=(("user", text),), tenant=tenant,
                                         objective=PRIORITY_OBJECTIVE[kind_of(tenant, picker)]))
    return Trace("token-fairness", seed, rate / TIME_SCALE, tuple(requests))


def fast_seed(spec: TokenFairnessSpec, seed: int) -> dict[str, Any]:
    saturated = run_fast(saturating(fast_trace(1.0, 25.0 * spec.pods * spec.max_num_seqs, seed, True)),
                         "round-robin", fast_config(spec.pods, None, seed, spec.max_num_seqs,
                                                    max_num_batched_tokens=spec.max_num_batched_tokens))
    capacity = sum(1 for s in saturated.status if s == OK) / (saturated.duration_s / TIME_SCALE)
    result: dict[str, Any] = {"seed": seed, "capacity_rps": capacity}
    for name in PICKERS:
        config = picker_config(name, spec.max_num_seqs, spec.kept_slot_share)
        result[name] = with_ratio({phase: phase_figures(fast_shots(
            fast_trace(spec.load * capacity, spec.phase_s, seed, with_heavy, name), config, spec.pods, seed,
            spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens))
            for phase, with_heavy in (("unloaded", False), ("loaded", True))})
    return result


def run_token_fairness(spec: TokenFairnessSpec, modes: tuple[str, ...], out: Path) -> dict[str, Any]:
    """Every seed in every mode (live: the pickers' order reversed every other seed); writes token-fairness.json
    and .md to `out`."""
    names = tuple(PICKERS)
    report: dict[str, Any] = {"spec": asdict(spec)}
    for mode in modes:
        seeds = [spec.seed + k for k in range(spec.repeats)]
        report[mode] = [fast_seed(spec, seed) for seed in seeds] if mode == "fast" else [
            asyncio.run(one_seed(spec, seed, names if k % 2 == 0 else names[::-1])) for k, seed in enumerate(seeds)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "token-fairness.json").write_text(json.dumps(report, indent=1))
    (out / "token-fairness.md").write_text("\n".join(markdown(report, modes)) + "\n")
    return report


def _spread(values: list[float | None], fmt: str, scale: float = 1.0) -> str:
    known = sorted(v * scale for v in values if v is not None)
    if not known:
        return "-"
    med = statistics.median(known)
    return f"{med:{fmt}} [{known[0]:{fmt}}-{known[-1]:{fmt}}]" if known[-1] > known[0] else f"{med:{fmt}}"


def markdown(report: dict[str, Any], modes: tuple[str, ...]) -> list[str]:
    spec = report["spec"]
    lines = ["# Token fairness under a heavy tenant", ""]
    for mode in modes:
        runs = report[mode]
        chunk = spec.get("max_num_batched_tokens")
        lines += [f"## {mode}: {spec['pods']} sim pods x {spec['max_num_seqs']} sequences"
                  f"{f', prefill chunk {chunk} tokens' if chunk else ''}; the bound keeps "
                  f"{spec.get('kept_slot_share', 0.1):g} of the slots; capacity for the mix "
                  f"{_spread([r['capacity_rps'] for r in runs], '.2f')} req/s; loaded at {spec['load']:g} x it, "
                  f"{spec['phase_s']:g} s phases; {len(runs)} seeds, medians [range]; TTFT in model ms", "",
                  "| fairness | light TTFT p90 unloaded | loaded | loaded / unloaded | light served | heavy served | "
                  "heavy TTFT p90 |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name in PICKERS:
            rows = [r[name] for r in runs]
            lines.append(
                f"| {name} | {_spread([p['unloaded']['light']['ttft_p90_s'] for p in rows], '.0f', 1e3)} | "
                f"{_spread([p['loaded']['light']['ttft_p90_s'] for p in rows], '.0f', 1e3)} | "
                f"{_spread([p['light_p90_ratio'] for p in rows], '.2f')}x | "
                f"{_spread([p['loaded']['light']['served_share'] for p in rows], '.2f')} | "
                f"{_spread([p['loaded']['heavy']['served_share'] for p in rows], '.2f')} | "
                f"{_spread([p['loaded']['heavy']['ttft_p90_s'] for p in rows], '.0f', 1e3)} |")
        lines.append("")
    return lines
