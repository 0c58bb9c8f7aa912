"""A pool serving two base models on disjoint pods, each with a LoRA adapter (`picker bench --scenario
mixed-models`): does every request land where its model is served, and do the picker's gains over round-robin
hold for each model?

The pool: 8 `picker sim` pods (the --profile), four serving `llama` with adapter `sql-lora`, four serving `qwen`
with adapter `chat-lora` (each four one process; a pod answers 404 for a model it does not serve, as vLLM does).
The workload: 24 shared-prefix groups (a 600-token system prompt each), 8 on `llama`, 8 on `qwen`, 4 on each
adapter; each request is a group's system prompt plus a 40-token question, 16 output tokens, streamed
completions, Poisson arrivals. Routers, each on fresh pods, interleaved over the repeats:
  - `round-robin`: one Envoy over the whole pool, no picker (it knows no models: a misroute is a pod's 404);
  - `round-robin-per-model`: an Envoy per model's pods, the client sending each request to its model's Envoy
    (one InferencePool per model without a picker: the fair baseline);
  - `prefix-hash` and `picker`: `picker serve --strategy prefix-hash` / the defaults, over the whole pool.
Per router and model: requests, answered, misrouted (a pod's 404), TTFT mean / p90 of the answered (client side),
prefix-cache hit rate (`usage.prompt_tokens_details.cached_tokens` / prompt tokens of the answered). mixed.json and
mixed.md go to the output directory.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from picker_lab.bench.client import stream_request
from picker_lab.bench.live import start_direct_envoy
from picker_lab.bench.workloads import text
from picker_lab.supervisor import Managed, process_scope, start_picker_fleet, start_sim

ROUTERS = ("round-robin", "round-robin-per-model", "prefix-hash", "picker")
FLEETS = (("llama", "sql-lora"), ("qwen", "chat-lora"))  # (base model, its adapter)
GROUPS = (("llama", 8), ("qwen", 8), ("sql-lora", 4), ("chat-lora", 4))
BASE_OF = {"llama": "llama", "sql-lora": "llama", "qwen": "qwen", "chat-lora": "qwen"}
SYSTEM_TOKENS, QUESTION_TOKENS, MAX_TOKENS = 600, 40, 16


@dataclass(frozen=True, slots=True)
class MixedSpec:
    profile: str = "llama3-8b-h100"
    pods_per_model: int = 4
    rate: float = 10.0  # requests/s over the whole pool
    seconds: float = 40.0
    repeats: int = 2
    seed: int = 1
    routers: tuple[str, ...] = ROUTERS


Request = tuple[float, str, str]  # send time, model, prompt


def workload(seed: int, rate: float, seconds: float) -> list[Request]:
    """Poisson arrivals over `seconds`, each a random group's system prompt plus its own question."""
    rng = random.Random(f"mixed-models:{seed}")
    groups = [(model, text(rng, SYSTEM_TOKENS)) for model, count in GROUPS for _ in range(count)]
    out: list[Request] = []
    at = rng.expovariate(rate)
    while at < seconds:
        model, system = rng.choice(groups)
        out.append((at, model, system + " " + text(rng, QUESTION_TOKENS)))
        at += rng.expovariate(rate)
    return out


async def replay(urls: dict[str, str], requests: list[Request]) -> list[dict[str, Any]]:
    """Send every request at its time to the URL of its model; what came back, with the model."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        start = time.monotonic()

        async def send(at: float, model: str, prompt: str) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
                    "stream_options": {"include_usage": True}}
            got = await stream_request(session, urls[model] + "/v1/completions", body, {})
            return {"model": model, **got}
        return list(await asyncio.gather(*(send(*r) for r in requests)))


def figures(shots: Iterable[dict[str, Any]]) -> dict[str, Any]:
    shots = list(shots)
    ok = [s for s in shots if s.get("status") == 200]
    ttft = sorted(s["first_chunk"] - s["sent"] for s in ok if s.get("first_chunk"))
    prompt = sum(int((s.get("usage") or {}).get("prompt_tokens") or 0) for s in ok)
    cached = sum(int(((s.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                 for s in ok)
    return {"requests": len(shots), "answered": len(ok), "misrouted": sum(1 for s in shots if s.get("status") == 404),
            "failed": sum(1 for s in shots if s.get("status") not in (200, 404)),
            "ttft_mean_ms": statistics.fmean(ttft) * 1e3 if ttft else None,
            "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] * 1e3 if ttft else None,
            "hit_rate": cached / prompt if prompt else None}


def start_pool(spec: MixedSpec, logdir: Path, started: list[Managed]) -> dict[str, list[str]]:
    """Each base model's pods (one sim process per model, its adapter loaded)."""
    pods: dict[str, list[str]] = {}
    for i, (model, adapter) in enumerate(FLEETS):
        sim = start_sim(spec.pods_per_model, logdir, model=model, name=f"sim-{model}",
                        extra=["--profile", spec.profile, "--lora-modules", f"{adapter}=/adapters/{adapter}",
                               "--seed", str(spec.seed + i)])
        started.append(sim.process)
        pods[model] = sim.addresses
    return pods


def start_router(router: str, pods: dict[str, list[str]], logdir: Path, started: list[Managed]) -> dict[str, str]:
    """The URL each model's requests go to."""
    pool = [address for addresses in pods.values() for address in addresses]
    if router == "round-robin-per-model":
        urls = {}
        for base, addresses in pods.items():
            direct, urls[base] = start_direct_envoy(logdir, addresses)
            started.append(direct)
        return {model: urls[base] for model, base in BASE_OF.items()}
    if router == "round-robin":
        direct, url = start_direct_envoy(logdir, pool)
        started.append(direct)
    elif router in ("prefix-hash", "picker"):
        flags = ["--log-level", "WARNING", *(["--strategy", "prefix-hash"] if router == "prefix-hash" else [])]
        fleet = start_picker_fleet(logdir, pool, flags=flags, name=f"picker-{router}")
        started.extend(fleet.processes)
        url = fleet.envoy.url
    else:
        raise ValueError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
    return dict.fromkeys(BASE_OF, url)


async def until_models_known(url: str, within: float = 30.0) -> None:
    """Until the picker lists every model of the pool (it has read what each pod serves)."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            async with session.get(url + "/v1/models") as response:
                listed = {m.get("id") for m in (await response.json(content_type=None)).get("data", [])}
            if set(BASE_OF) <= listed:
                return
            await asyncio.sleep(0.2)
    raise RuntimeError("the picker never listed every model of the pool")


async def run_once(spec: MixedSpec, router: str, requests: list[Request]) -> dict[str, Any]:
    with process_scope(f"mixed-{router}") as (logdir, started):
        pods = start_pool(spec, logdir, started)
        urls = start_router(router, pods, logdir, started)
        if router in ("prefix-hash", "picker"):
            await until_models_known(urls["llama"])
        shots = await replay(urls, requests)
    return {"all": figures(shots), **{m: figures(s for s in shots if s["model"] == m) for m in BASE_OF}}


def run_mixed(spec: MixedSpec, out: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(spec.repeats):
        requests = workload(spec.seed + repeat, spec.rate, spec.seconds)
        for router in spec.routers:
            print(f"mixed models: repeat {repeat + 1}/{spec.repeats}, {router}, {len(requests)} requests", flush=True)
            runs.setdefault(router, []).append(asyncio.run(run_once(spec, router, requests)))
    result = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}, "runs": runs,
              "median": {router: _medians(rs) for router, rs in runs.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed.json").write_text(json.dumps(result, indent=2))
    (out / "mixed.md").write_text(report(result))
    return result


def _medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for model in ("all", *BASE_OF):
        row: dict[str, float | None] = {}
        for key in ("requests", "answered", "misrouted", "failed", "ttft_mean_ms", "ttft_p90_ms", "hit_rate"):
            values = [r[model][key] for r in runs if r[model][key] is not None]
            row[key] = statistics.median(values) if values else None
        out[model] = row
    return out


def report(result: dict[str, Any]) -> str:
    spec = result["spec"]
    lines = [f"# Mixed models: 2 base models x {spec['pods_per_model']} pods + 2 adapters",
             "", f"{spec['rate']:g} req/s for {spec['seconds']:g} s, medians of {spec['repeats']} repeats "
             "(`picker bench --scenario mixed-models`).", "",
             "| router | model | requests | misrouted (404) | TTFT mean | TTFT p90 | hit rate | TTFT mean vs "
             "round-robin-per-model |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = result["median"].get("round-robin-per-model", {})
    for router, rows in result["median"].items():
        for model, row in rows.items():
            ref = (base.get(model) or {}).get("ttft_mean_ms")
            ratio = f"{row['ttft_mean_ms'] / ref:.2f}" if ref and row["ttft_mean_ms"] else "-"
            lines.append(f"| {router} | {model} | {row['requests']:.0f} | {row['misrouted']:.0f} | "
                         f"{_ms(row['ttft_mean_ms'])} | {_ms(row['ttft_p90_ms'])} | {_rate(row['hit_rate'])} | "
                         f"{ratio} |")
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
