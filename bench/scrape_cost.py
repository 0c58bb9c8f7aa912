"""What one /metrics scrape costs a real vLLM server: CPU time and the delay it adds to the tokens it streams.

    make scrape-cost        # or: .venv/bin/python bench/scrape_cost.py [--phase-seconds 15] [--rounds 2]

vLLM renders /metrics in its API server process, the asyncio loop that also parses requests and streams every
token, so a scrape competes with the tokens of every request on that pod. This starts one real vLLM CPU server
(bench/.venvs/vllm, tiny local model, engine bound to core 0) and measures, phase by phase, in interleaved rounds:

- idle: the API server's CPU time at 0, 20 and 80 scrapes/s (1 and 4 picker replicas at the old 50 ms cadence)
  and 2 and 8 scrapes/s (500 ms), so CPU per scrape = extra CPU / scrapes;
- under traffic (2 closed-loop streaming completions, ~600-token prompts, 64 output tokens): TTFT and
  inter-token latency at the same scrape rates, so the event-loop delay shows as the change against no scrapes;
- both for the whole page and for the page cut down to the series the picker reads (`/metrics/?name[]=...`,
  what `picker serve` asks for by default: `--metrics-only-read-series`).

Writes bench/out/scrape_cost.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picker.endpoints.scraper import MetricsTarget  # noqa: E402
from picker.endpoints.state import Endpoint  # noqa: E402
from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.bench.summary import percentile  # noqa: E402

# (label, scrapers, interval, only the series read): scrapers stand for picker replicas, each polling on its own
# cadence, for the whole page or the filtered one
RATES: tuple[tuple[str, int, float, bool], ...] = (
    ("no scrapes", 0, 0.0, False),
    ("1 replica @ 500 ms", 1, 0.5, False),
    ("4 replicas @ 500 ms", 4, 0.5, False),
    ("1 replica @ 50 ms", 1, 0.05, False),
    ("4 replicas @ 50 ms", 4, 0.05, False),
    ("1 replica @ 500 ms, series read", 1, 0.5, True),
    ("1 replica @ 50 ms, series read", 1, 0.05, True),
    ("4 replicas @ 50 ms, series read", 4, 0.05, True),
)


def metrics_urls(server: engine.VllmServer) -> tuple[str, str]:
    """The whole page's URL and the filtered one's, as `picker serve` builds them."""
    pod = Endpoint.from_address(server.address)
    filtered = MetricsTarget().filtered_url(pod)
    assert filtered is not None
    return MetricsTarget(only_read_series=False).url(pod), filtered


@dataclass
class Phase:
    label: str
    scrapers: int
    interval: float
    traffic: bool
    seconds: float
    url: str = ""
    scrapes: int = 0
    scrape_latency: list[float] = field(default_factory=list)
    api_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    completed: int = 0


async def scraper(session: aiohttp.ClientSession, url: str, interval: float, phase: Phase, stop: asyncio.Event,
                  offset: float) -> None:
    await asyncio.sleep(offset)
    loop = asyncio.get_running_loop()
    next_tick = loop.time()
    while not stop.is_set():
        start = time.perf_counter()
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url) as resp:
                await resp.read()
            phase.scrapes += 1
            phase.scrape_latency.append(time.perf_counter() - start)
        next_tick += interval
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_tick - loop.time()))


async def streamer(session: aiohttp.ClientSession, url: str, phase: Phase, stop: asyncio.Event, rng: random.Random
                   ) -> None:
    while not stop.is_set():
        prompt = [rng.randrange(10, engine.VOCAB - 10) for _ in range(600)]
        body = {"model": engine.MODEL_NAME, "prompt": prompt, "max_tokens": 64, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        sent = time.perf_counter()
        last: float | None = None
        async with session.post(url + "/v1/completions", json=body) as resp:
            async for raw in resp.content:
                if not raw.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is None:
                    phase.ttft.append(now - sent)
                else:
                    phase.itl.append(now - last)
                last = now
        phase.completed += 1


async def run_phase(server: engine.VllmServer, phase: Phase, seed: int) -> None:
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        cpu_before = engine.group_cpu_seconds(server.proc.pid)
        tasks = [asyncio.create_task(scraper(session, phase.url, phase.interval, phase, stop,
                                             phase.interval * i / max(1, phase.scrapers)))
                 for i in range(phase.scrapers)]
        rng = random.Random(seed)
        if phase.traffic:
            tasks += [asyncio.create_task(streamer(session, server.url, phase, stop, rng)) for _ in range(2)]
        await asyncio.sleep(phase.seconds)
        stop.set()
        cpu_after = engine.group_cpu_seconds(server.proc.pid)
        await asyncio.gather(*tasks, return_exceptions=True)
    pid = server.proc.pid
    phase.api_cpu_s = cpu_after.get(pid, 0.0) - cpu_before.get(pid, 0.0)
    phase.engine_cpu_s = sum(v - cpu_before.get(k, 0.0) for k, v in cpu_after.items() if k != pid)


def summarize(phases: list[Phase]) -> dict[str, Any]:
    """Per (label, traffic): means over rounds; CPU per scrape against the no-scrape phase of the same kind."""
    out: dict[str, Any] = {}
    for traffic in (False, True):
        kind = "traffic" if traffic else "idle"
        base = [p for p in phases if p.traffic == traffic and p.scrapers == 0]
        base_cpu = statistics.mean(p.api_cpu_s / p.seconds for p in base)
        base_itl = [x for p in base for x in p.itl]
        base_ttft = [x for p in base for x in p.ttft]
        rows = []
        for label, scrapers, interval, _ in RATES:
            mine = [p for p in phases if p.traffic == traffic and p.label == label]
            if not mine:
                continue
            secs = sum(p.seconds for p in mine)
            scrapes = sum(p.scrapes for p in mine)
            api_cpu = sum(p.api_cpu_s for p in mine) / secs
            itl = [x for p in mine for x in p.itl]
            ttft = [x for p in mine for x in p.ttft]
            lat = [x for p in mine for x in p.scrape_latency]
            per_round = [p.api_cpu_s / p.seconds for p in mine]
            rows.append({
                "label": label, "scrapers": scrapers, "interval_s": interval,
                "scrapes_per_s": scrapes / secs,
                "api_cpu_share": api_cpu, "api_cpu_share_rounds": per_round,
                "extra_api_cpu_share": api_cpu - base_cpu,
                "cpu_ms_per_scrape": (api_cpu - base_cpu) * secs / scrapes * 1000 if scrapes else float("nan"),
                "engine_cpu_share": sum(p.engine_cpu_s for p in mine) / secs,
                "scrape_latency_ms_p50": percentile(lat, 50) * 1000, "scrape_latency_ms_p99": percentile(lat, 99) * 1000,
                "ttft_ms_mean": statistics.mean(ttft) * 1000 if ttft else float("nan"),
                "ttft_ms_p90": percentile(ttft, 90) * 1000,
                "itl_ms_p50": percentile(itl, 50) * 1000, "itl_ms_p99": percentile(itl, 99) * 1000,
                "ttft_ratio": (statistics.mean(ttft) / statistics.mean(base_ttft)) if ttft and base_ttft else None,
                "itl_p99_ratio": (percentile(itl, 99) / percentile(base_itl, 99)) if itl and base_itl else None,
                "completed": sum(p.completed for p in mine),
            })
        out[kind] = rows
    return out


def report(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# What /metrics scrapes cost a real vLLM server",
        "",
        f"vLLM {engine.VLLM_VERSION} on the CPU, tiny local Llama, engine bound to one core; {meta['rounds']} "
        f"interleaved rounds of {meta['phase_seconds']:.0f} s per phase; /metrics page {meta['metrics_bytes']} bytes, "
        f"{meta['filtered_bytes']} with only the series the picker reads ('series read'). "
        "CPU is the API server process (the loop that renders /metrics and streams tokens), as a share of one core.",
        "",
        "## Idle server",
        "",
        "| scrapers | scrapes/s | API server CPU | extra CPU | CPU ms per scrape | scrape latency p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary["idle"]:
        lines.append(f"| {r['label']} | {r['scrapes_per_s']:.1f} | {r['api_cpu_share'] * 100:.1f} % | "
                     f"{r['extra_api_cpu_share'] * 100:+.1f} % | {r['cpu_ms_per_scrape']:.2f} | "
                     f"{r['scrape_latency_ms_p50']:.1f} / {r['scrape_latency_ms_p99']:.1f} |")
    lines += [
        "",
        "## Under traffic (2 streaming requests at all times)",
        "",
        "| scrapers | scrapes/s | API server CPU | CPU ms per scrape | TTFT mean ms (x none) | ITL p50 ms | "
        "ITL p99 ms (x none) | requests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["traffic"]:
        ratio = f" ({r['ttft_ratio']:.2f}x)" if r["ttft_ratio"] else ""
        itl_ratio = f" ({r['itl_p99_ratio']:.2f}x)" if r["itl_p99_ratio"] else ""
        lines.append(f"| {r['label']} | {r['scrapes_per_s']:.1f} | {r['api_cpu_share'] * 100:.1f} % | "
                     f"{r['cpu_ms_per_scrape']:.2f} | {r['ttft_ms_mean']:.1f}{ratio} | {r['itl_ms_p50']:.1f} | "
                     f"{r['itl_ms_p99']:.1f}{itl_ratio} | {r['completed']} |")
    lines.append("")
    return "\n".join(lines)


async def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    server = engine.fresh_server("scrape-cost", block_size=64, num_blocks=160, cpu=0)
    try:
        await asyncio.to_thread(server.wait_healthy)
        whole, filtered = metrics_urls(server)
        async with aiohttp.ClientSession() as session:
            async with session.get(whole) as resp:
                metrics_bytes = len(await resp.read())
            async with session.get(filtered) as resp:
                filtered_bytes = len(await resp.read())
        warm = Phase("warm-up", 0, 0.0, True, 5.0)
        await run_phase(server, warm, 0)
        phases: list[Phase] = []
        for rnd in range(args.rounds):
            order = list(RATES) if rnd % 2 == 0 else list(reversed(RATES))
            for traffic in (False, True):
                for label, scrapers, interval, only_read in order:
                    phase = Phase(label, scrapers, interval, traffic, args.phase_seconds,
                                  filtered if only_read else whole)
                    await run_phase(server, phase, rnd * 100 + scrapers)
                    engine.log(f"round {rnd} {'traffic' if traffic else 'idle'} {label}: {phase.scrapes} scrapes, "
                               f"API CPU {phase.api_cpu_s / phase.seconds * 100:.1f} %")
                    phases.append(phase)
    finally:
        server.stop()
    meta = {"rounds": args.rounds, "phase_seconds": args.phase_seconds, "metrics_bytes": metrics_bytes,
            "filtered_bytes": filtered_bytes}
    return summarize(phases), meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(engine.OUT))
    args = parser.parse_args()
    summary, meta = asyncio.run(measure(args))
    engine.write_outputs(args.out, "scrape_cost", {"meta": meta, "summary": summary}, report(summary, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
