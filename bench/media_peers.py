"""Routers in front of two real vLLM servers of a multimodal model, under load: do requests for an image keep
reaching the server that holds it? (opt-in: vLLM 0.32 CPU, ~9 minutes a repeat)

    make media-peers     # or: .venv/bin/python bench/media_peers.py [--rate 4] [--seconds 90] [--repeats 3]

Two vLLM CPU servers of the random-weight Idefics3 (lab/picker_lab/bench/vllm_media.py), one per core, each with
`--kv-blocks` blocks of 32 tokens (32,768 tokens by default: fourteen of the images). The workload: a shared system
prompt, then one of `--images` images (640 x 480, 2,228 tokens each to this model: together about 1.4x what one
server holds, well under what both do), then a question; arrivals Poisson at `--rate` a second for `--seconds`,
every image equally likely. An image a server holds costs it ~20 ms; one it must encode and prefill, ~250 ms.

Routers, each in turn on the same servers (their caches reset before each) and on the same arrivals, the order
reversed every other repeat: the picker behind Envoy (`imageLayout: tiles` for the model); smg, sglang-router and
vllm-router in their cache-aware mode, as the proxies they are (the servers started with `--enable-scale-out`,
which vllm-router needs); Envoy alone (round-robin). Per router: the time to the first token (the requests ask
for one token) p50 and p90, the share of prompt tokens served from cache, and how many requests each server took.
Each repeat's images are its own. Writes bench/out/media_peers.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from media_real import TILES, chat, start_picker_for  # noqa: E402

from picker.endpoints.metrics import parse_metrics  # noqa: E402
from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.bench import vllm_media  # noqa: E402
from picker_lab.bench.live import start_direct_envoy  # noqa: E402
from picker_lab.bench.peers import PEERS, start_replicas  # noqa: E402
from picker_lab.media_files import data_url, png  # noqa: E402
from picker_lab.supervisor import Managed, process_scope  # noqa: E402

ROUTERS = ("picker", "smg", "sglang-router", "vllm-router", "round-robin")
SYSTEM = "You describe pictures for a museum catalogue, in one short sentence."


def prompt_count(address: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return parse_metrics(response.read().decode()).prompt_count


def start_router(name: str, pool: list[str], logdir: Path, config: Path) -> tuple[list[Managed], str]:
    """The router's processes and the URL clients send to."""
    if name == "picker":
        fleet = start_picker_for(logdir, pool, config, [], "picker")
        return fleet.processes, fleet.envoy.url
    if name == "round-robin":
        envoy_process, url = start_direct_envoy(logdir, pool)
        return [envoy_process], url
    processes, urls = start_replicas(PEERS[name], [f"http://{a}" for a in pool], logdir)
    return processes, urls[0]


async def load(url: str, images: list[str], rate: float, seconds: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals of image questions; each request's latency (one token asked: its first) and usage."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int, str]] = []
    at = rng.expovariate(rate)
    while at < seconds:
        arrivals.append((at, rng.randrange(len(images)), f"question {len(arrivals)}: what is shown here?"))
        at += rng.expovariate(rate)
    latencies: list[float] = []
    prompt = cached = failed = 0

    async def one(session: aiohttp.ClientSession, start: float, when: float, image: int, question: str) -> None:
        nonlocal prompt, cached, failed
        await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
        sent = time.perf_counter()
        body = chat(images[image], SYSTEM, question)
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200:
                    failed += 1
                    return
        except (aiohttp.ClientError, TimeoutError):
            failed += 1
            return
        latencies.append(time.perf_counter() - sent)
        usage = answer["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, start, *a) for a in arrivals))
    latencies.sort()
    return {"requests": len(arrivals), "failed": failed, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": cached / prompt if prompt else 0.0,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
            "p90_ms": 1000 * latencies[int(0.9 * (len(latencies) - 1))] if latencies else None}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks of 32 tokens per server")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    routers = [r for r in args.routers.split(",") if r]
    engine.install()
    model = vllm_media.build_media_model("idefics3")
    runs: list[dict[str, Any]] = []
    with process_scope("media-peers") as (logdir, started):
        servers = [vllm_media.start_media_server(model, f"vllm-{i}", cpu=i, num_blocks=args.kv_blocks, images=1,
                                                 extra=("--enable-scale-out",), resettable=True) for i in range(2)]
        try:
            for server in servers:
                server.wait_healthy()
            pool = [server.address for server in servers]
            config = logdir / "media.yaml"
            config.write_text(json.dumps({"multimodal": {"models": {engine.MODEL_NAME: TILES}}}))
            for repeat in range(args.repeats):
                order = routers if repeat % 2 == 0 else routers[::-1]
                for k, name in enumerate(order):
                    shades = random.Random(repeat * 100 + k)  # each run's images its own
                    images = [data_url(png(640, 480, shades.randrange(256))) for _ in range(args.images)]
                    for server in servers:
                        server.reset_prefix_cache()
                    processes, url = start_router(name, pool, logdir, config)
                    started.extend(processes)
                    before = [prompt_count(a) for a in pool]
                    try:
                        figures = await load(url, images, args.rate, args.seconds, seed=repeat)
                    finally:
                        for process in processes:
                            process.stop()
                    figures["per_server"] = [prompt_count(a) - b for a, b in zip(pool, before, strict=True)]
                    runs.append({"repeat": repeat, "router": name, **figures})
                    print(f"[media-peers] repeat {repeat} {name}: p50 {figures['p50_ms']:.0f} ms, p90 "
                          f"{figures['p90_ms']:.0f} ms, cached {figures['cached_share']:.0%}, "
                          f"failed {figures['failed']}", file=sys.stderr, flush=True)
        finally:
            for server in servers:
                server.stop()
    result = {"args": {k: str(v) for k, v in vars(args).items() if k != "out"}, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "media_peers.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result, routers)
    (args.out / "media_peers.md").write_text(text)
    print(text)
    return 0


def report(result: dict[str, Any], routers: list[str]) -> str:
    a = result["args"]
    lines = ["# Routers in front of two real vLLM servers of a multimodal model (a random-weight Idefics3)", "",
             f"{a['images']} images of 2,228 tokens after a shared system prompt, {a['rate']} requests a second for "
             f"{a['seconds']} s, {a['kv_blocks']} KV blocks of 32 tokens a server; medians of {a['repeats']} "
             "repeats [range].", "",
             "| router | TTFT p50 ms | TTFT p90 ms | p90 / picker's | prompt tokens from cache | failed | "
             "requests on each server, per repeat |", "|---|---:|---:|---:|---:|---:|---|"]
    runs = result["runs"]

    def spread(values: list[float], fmt: str) -> str:
        values = sorted(values)
        med = statistics.median(values)
        return f"{med:{fmt}} [{values[0]:{fmt}}-{values[-1]:{fmt}}]" if len(values) > 1 else f"{med:{fmt}}"

    ours = {r["repeat"]: r["p90_ms"] for r in runs if r["router"] == "picker"}
    for name in routers:
        mine = [r for r in runs if r["router"] == name]
        if not mine:
            continue
        ratios = [r["p90_ms"] / ours[r["repeat"]] for r in mine if r["repeat"] in ours and ours[r["repeat"]]]
        lines.append(f"| {name} | {spread([r['p50_ms'] for r in mine], '.0f')} | "
                     f"{spread([r['p90_ms'] for r in mine], '.0f')} | {spread(ratios, '.2f') if ratios else '-'} | "
                     f"{spread([100 * r['cached_share'] for r in mine], '.0f')} % | "
                     f"{sum(r['failed'] for r in mine)} | "
                     f"{'; '.join('/'.join(f'{n:.0f}' for n in r['per_server']) for r in mine)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
