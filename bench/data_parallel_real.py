"""Does a prefix stay on its rank of a real data-parallel vLLM server? (opt-in: vLLM 0.32 CPU, ~4 minutes)

    make dp-real     # or: .venv/bin/python bench/data_parallel_real.py [--url 127.0.0.1:8000] [--groups 8]

Starts one real vLLM CPU server with `--data-parallel-size 2` (bench/.venvs/vllm, the tiny local model, prefix
caching, blocks of 128 tokens), or uses the one at `--url`, and puts the picker and Envoy in front of it in turn:
routing each rank as a target of its own (the default: the ranks read from the server's `engine` label), the same
in precise mode (the server's KV events: each engine publishes its own on the picker's endpoint port + its rank;
only with a server started here, as it must be told where), and routing the server as one
(`--data-parallel-ranks 1`: vLLM balances its engines itself). Each time it sends `--groups` system prompts,
each followed by three more requests sharing it, one at a time, and reads from vLLM's own metrics which engine
served them and what each engine's prefix cache hit; in precise mode also what the picker's view of each rank
holds and which ranks' messages it applied. Each run uses prompts of its own, so one run's cache does not help
the next. Writes bench/out/data_parallel_real.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picker.endpoints.metrics import parse_metrics  # noqa: E402
from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.supervisor import (  # noqa: E402
    free_port,
    free_port_range,
    metric_sum,
    process_scope,
    start_envoy,
    start_picker,
    wait_until,
)

BLOCK, BLOCKS = 128, 64  # per engine


def engines(address: str) -> dict[int, tuple[float, float, float]]:
    """engine -> (finished prompts, prefix-cache queries, hits) as the server's page says."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        m = parse_metrics(response.read().decode())
    assert m.engines is not None, "the server does not label several engines"
    return {i: (e.prompt_count, e.prefix_queries, e.prefix_hits) for i, e in m.engines.items()}


async def run(address: str, logdir: Path, started: list[Any], mode: str, groups: int, seed: int,
              events: tuple[str, int] | None = None) -> dict[str, Any]:
    """One routing `mode` (ranks, precise: with `events`' endpoint and replay port, whole) over `groups` prompts."""
    extra = ["--data-parallel-ranks", "1"] if mode == "whole" else []
    if mode == "precise":
        assert events is not None
        extra = ["--kv-events-endpoint", events[0], "--kv-events-replay-port", str(events[1]),
                 "--prefix-mode", "precise", "--tokenizer", str(engine.MODEL_DIR)]
    picker = start_picker(logdir, endpoints=[address], extra=extra, name=f"picker-{mode}")
    started.append(picker.process)
    want = {address} if mode == "whole" else {f"{address}#0", f"{address}#1"}
    wait_until(lambda: picker.routes_to(want), 30, "the picker's targets", picker.process)
    envoy = start_envoy(logdir, picker, [address], name=f"envoy-{mode}")
    started.append(envoy.process)
    rng = random.Random(seed)
    vocabulary = engine.vocabulary()
    before = engines(address)
    cached = prompt = 0
    async with aiohttp.ClientSession() as session:
        for g in range(groups):
            system = " ".join(rng.choice(vocabulary) for _ in range(rng.randrange(300, 500)))
            for turn in range(4):
                body = {"model": engine.MODEL_NAME, "max_tokens": 2, "temperature": 0.0,
                        "prompt": f"{system}\nquestion {g}.{turn}: " + " ".join(rng.choice(vocabulary)
                                                                              for _ in range(20))}
                async with session.post(f"{envoy.url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    usage = (await response.json())["usage"]
                if turn:  # the follow-ups: what sharing the group's prompt could have saved
                    prompt += usage["prompt_tokens"]
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    after = engines(address)
    metrics = f"{picker.host}:{picker.metrics_port}"
    views = {what: {t: metric_sum(metrics, name, model_server_endpoint=t) for t in sorted(want)}
             for what, name in (("blocks", "picker_precise_blocks"), ("batches", "picker_kv_events_batches_total"))
             } if mode == "precise" else {}
    envoy.process.stop()
    picker.process.stop()
    per_engine = {i: {"requests": after[i][0] - before[i][0], "queries": after[i][1] - before[i][1],
                      "hits": after[i][2] - before[i][2]} for i in after}
    return {"mode": mode, "follow_up_prompt_tokens": prompt, "follow_up_cached_tokens": cached,
            "follow_up_cached_share": cached / prompt if prompt else 0.0, "engines": per_engine, **views}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="", help="host:port of a running vLLM with --data-parallel-size 2 (no "
                        "precise run: its KV events go where it was told)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    with process_scope("dp-real") as (logdir, started):
        address = args.url
        if not address:
            engine.install()
            engine.build_model()
            # rank r publishes on the endpoint's port + r and replays on the replay port + r (vLLM's rule)
            port, endpoint, replay = free_port(), f"tcp://{engine.HOST}:{free_port_range(2)}", free_port_range(2)
            address = f"{engine.HOST}:{port}"
            flags = engine.kv_events_flags(endpoint, f"kv@{address}@{engine.MODEL_NAME}", f"tcp://*:{replay}")
            server = engine.start_server(Path(tempfile.mkdtemp(prefix="picker-dp-real-")), block_size=BLOCK,
                                         num_blocks=BLOCKS, port=port, extra=["--data-parallel-size", "2", *flags])
            try:
                server.wait_healthy()
                results = [await run(address, logdir, started, mode, args.groups, seed, (endpoint, replay))
                           for seed, mode in enumerate(("ranks", "precise", "whole"))]
            finally:
                server.stop()
        else:
            results = [await run(address, logdir, started, mode, args.groups, seed)
                       for seed, mode in enumerate(("ranks", "whole"))]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_parallel_real.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# A real vLLM 0.32 CPU server of two data-parallel ranks behind the picker", "",
             f"{args.groups} system prompts of 300-500 words, each sent 4 times one at a time (`make dp-real`).", "",
             "| routing | follow-ups' prompt tokens cached | engine 0: requests, hit tokens | engine 1: requests, "
             "hit tokens |", "|---|---|---|---|"]
    for r in results:
        e = r["engines"]
        name = {"ranks": "each rank a target", "precise": "each rank a target, precise (KV events)",
                "whole": "the server as one"}[r["mode"]]
        lines.append(f"| {name} | "
                     f"{r['follow_up_cached_share']:.0%} ({r['follow_up_cached_tokens']}/{r['follow_up_prompt_tokens']})"
                     f" | {e[0]['requests']:g}, {e[0]['hits']:g} | {e[1]['requests']:g}, {e[1]['hits']:g} |")
    for r in results:
        if r["mode"] == "precise":
            lines += ["", "Precise run, the picker's views at the end: blocks "
                      + ", ".join(f"{k} {v:g}" for k, v in sorted(r["blocks"].items())) + "; messages applied "
                      + ", ".join(f"{k} {v:g}" for k, v in sorted(r["batches"].items())) + "."]
    (args.out / "data_parallel_real.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
