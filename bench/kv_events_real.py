"""Does the precise view follow a real vLLM's KV events? (opt-in: one vLLM 0.32 CPU server, ~3 minutes)

    make kv-events-real     # or: .venv/bin/python bench/kv_events_real.py [--prompts 120]

Starts one real vLLM CPU server (bench/.venvs/vllm, the tiny local model, prefix caching, 160 blocks of 64 tokens:
small enough to evict) publishing its KV events to the picker's subscriber (bind mode, topic
`kv@<address>@tiny`, replay socket on), and sends chats: groups sharing a system prompt and one-off ones. For
each chat sent a second time, the view's prediction (the blocks it says the server holds of the prompt, from the
local tokenizer's ids: `--tokenizer` on the model directory) is compared with the tokens vLLM reports as cached
(`usage.prompt_tokens_details.cached_tokens`). Reports how often they agree exactly, the subscriber's counters
and the view's size. Writes bench/out/kv_events_real.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picker.kvevents.subscriber import KVEventSubscriber, ZmqReplayer  # noqa: E402
from picker.prefix.precise import PreciseIndex, token_keys  # noqa: E402
from picker.prefix.tokens import LocalTokenizer  # noqa: E402
from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.supervisor import free_port  # noqa: E402

BLOCK, BLOCKS = 64, 160


def chats(rng: random.Random, n: int) -> list[list[dict[str, str]]]:
    vocabulary = engine.vocabulary()

    def words(k: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(k))
    systems = [words(rng.randrange(100, 300)) for _ in range(6)]
    out = []
    for i in range(n):
        system = systems[i % len(systems)] if i % 3 else words(rng.randrange(50, 300))
        out.append([{"role": "system", "content": system}, {"role": "user", "content": words(rng.randrange(5, 60))}])
    return out


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> int:
    body = {"model": engine.MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0.0}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        usage = (await resp.json())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    engine.install()
    engine.build_model()
    local = LocalTokenizer(engine.MODEL_DIR)
    endpoint, replay, port = f"tcp://127.0.0.1:{free_port()}", free_port(), free_port()
    address = f"127.0.0.1:{port}"
    index = PreciseIndex()
    subscriber = KVEventSubscriber(endpoint, index, {address: address}.get, replayer=ZmqReplayer(replay))
    listening = asyncio.create_task(subscriber.run())
    await subscriber.bound.wait()
    logdir = Path(tempfile.mkdtemp(prefix="picker-kv-events-real-"))
    server = engine.start_server(logdir, block_size=BLOCK, num_blocks=BLOCKS, port=port, cpu=0, extra=[
        *engine.kv_events_flags(endpoint, f"kv@{address}@{engine.MODEL_NAME}", f"tcp://*:{replay}")])
    agree = differ = 0
    samples: list[dict[str, int]] = []
    try:
        await asyncio.to_thread(server.wait_healthy)
        rng = random.Random(11)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for messages in chats(rng, args.prompts):
                before = subscriber.stats.batches
                await chat(session, server.url, messages)  # the first time: it computes and stores
                for _ in range(50):  # its events on their way (a chat that stored nothing sends none)
                    if subscriber.stats.batches > before:
                        break
                    await asyncio.sleep(0.01)
                ids = local.ids({"messages": messages}) or []
                predicted = index.pod(address).matched(token_keys(ids, BLOCK), 0.0) * BLOCK
                predicted = min(predicted, (len(ids) - 1) // BLOCK * BLOCK)  # vLLM never hits the last token
                cached = await chat(session, server.url, messages)
                agree += predicted == cached
                differ += predicted != cached
                if predicted != cached and len(samples) < 10:
                    samples.append({"tokens": len(ids), "predicted": predicted, "cached": cached})
    finally:
        server.stop()
        listening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listening
    s = subscriber.stats
    return {"prompts": args.prompts, "agree": agree, "differ": differ, "disagreements": samples,
            "batches": s.batches, "gaps": s.gaps, "replayed": s.replayed, "resets": s.resets,
            "malformed": s.malformed, "blocks_in_view": len(index.pod(address).keys)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--out", default=str(engine.OUT))
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    text = (f"# The precise view against a real vLLM 0.32 (bench/kv_events_real.py)\n\n"
            f"{result['agree']} of {result['prompts']} re-sent chats: the view's predicted hit equals vLLM's "
            f"cached_tokens exactly ({result['differ']} differ). Subscriber: {result['batches']} batches, "
            f"{result['gaps']} gaps, {result['replayed']} replayed, {result['resets']} resets, {result['malformed']} "
            f"malformed; {result['blocks_in_view']} blocks in the view at the end (the server has {BLOCKS}).\n")
    if result["disagreements"]:
        text += "\nDisagreements (first 10): " + json.dumps(result["disagreements"]) + "\n"
    engine.write_outputs(args.out, "kv_events_real", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
