"""What precise prefix routing's `POST /tokenize` costs a real vLLM server, and the picker's decision.

    make tokenize-cost      # or: .venv/bin/python bench/tokenize_cost.py [--calls 200] [--phase-seconds 20]

With `--kv-events-endpoint`, the picker asks a pod for each prompt's token ids before it schedules the request:
one `/tokenize` call per request, rendered and tokenized in the pod's API server (the asyncio loop that also
streams tokens). This starts one real vLLM CPU server (bench/.venvs/vllm, the tiny local model, engine on core 0)
and measures:

- the call's latency (what the picker's decision waits for), sequentially, for chat prompts of ~600 and ~3,000
  tokens, p50 / p99;
- the API server's CPU per call (CPU time over a burst of calls / calls);
- under traffic (open-loop streaming chat completions of ~1,070 tokens, 32 output tokens, Poisson at `--rate`,
  the same arrivals for both variants), TTFT and inter-token latency with and without a `/tokenize` call ahead
  of every request (as the picker makes it), interleaved over `--rounds` rounds. (Closed loops are no good
  here: the call's delay desynchronises two loops' prefills, which lowers their TTFT.)

It also checks the local tokenizer (`--tokenizer` on the model's directory) against the server's ids and times it
on ~4 KB and ~32 KB chats (the decision's cost with a local tokenizer). Writes bench/out/tokenize_cost.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picker.prefix.tokens import LocalTokenizer  # noqa: E402
from picker_lab.bench import vllm_engine as engine  # noqa: E402


def messages(rng: random.Random, words: int) -> list[dict[str, str]]:
    vocabulary = engine.vocabulary()
    text = " ".join(rng.choice(vocabulary) for _ in range(words))
    return [{"role": "system", "content": text[: len(text) // 2]}, {"role": "user", "content": text[len(text) // 2:]}]


async def tokenize(session: aiohttp.ClientSession, url: str, chat: list[dict[str, str]]) -> tuple[float, int]:
    start = time.perf_counter()
    async with session.post(url + "/tokenize", json={"model": engine.MODEL_NAME, "messages": chat}) as resp:
        body = await resp.json()
    return time.perf_counter() - start, int(body["count"])


async def latency(session: aiohttp.ClientSession, url: str, words: int, calls: int) -> dict[str, float]:
    rng = random.Random(words)
    times, counts = [], []
    for _ in range(calls):
        took, count = await tokenize(session, url, messages(rng, words))
        times.append(took)
        counts.append(count)
    times.sort()
    return {"tokens": statistics.fmean(counts), "p50_ms": times[len(times) // 2] * 1e3,
            "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3}


async def cpu_per_call(session: aiohttp.ClientSession, server: engine.VllmServer, words: int, calls: int) -> float:
    rng = random.Random(words + 1)
    prompts = [messages(rng, words) for _ in range(calls)]
    idle_before = server.api_server_cpu_seconds()
    await asyncio.sleep(2.0)
    idle = server.api_server_cpu_seconds() - idle_before  # the loop's own ticking over 2 s
    before, began = server.api_server_cpu_seconds(), time.perf_counter()
    for chat in prompts:
        await tokenize(session, server.url, chat)
    spent = server.api_server_cpu_seconds() - before - idle * (time.perf_counter() - began) / 2.0
    return spent / calls


async def streams(server: engine.VllmServer, seconds: float, rate: float, with_tokenize: bool, seed: int
                  ) -> dict[str, Any]:
    """Open-loop streaming chats, Poisson at `rate`/s, the same arrivals for either variant; with_tokenize: a
    /tokenize call first, as the picker makes it (its time counts in the TTFT)."""
    rng = random.Random(seed)
    arrivals, at = [], rng.expovariate(rate)
    while at < seconds:
        arrivals.append((at, messages(rng, 450)))
        at += rng.expovariate(rate)
    ttft: list[float] = []
    itl: list[float] = []

    async def one(session: aiohttp.ClientSession, start: float, offset: float, chat: list[dict[str, str]]) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        sent = time.perf_counter()
        if with_tokenize:
            await tokenize(session, server.url, chat)
        body = {"model": engine.MODEL_NAME, "messages": chat, "max_tokens": 32, "ignore_eos": True,
                "stream": True, "temperature": 0.0}
        last: float | None = None
        async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
            async for raw in resp.content:
                if not raw.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - sent)
                else:
                    itl.append(now - last)
                last = now

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, start, offset, chat) for offset, chat in arrivals))
    return {"requests": len(ttft), "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
            "itl_mean_ms": statistics.fmean(itl) * 1e3 if itl else None}


async def local_agrees(session: aiohttp.ClientSession, url: str, local: LocalTokenizer, n: int) -> dict[str, int]:
    """Chats (a third sharing one long system prompt: the local tokenizer's remembered pieces) and completions of
    random lengths: do the local ids equal the server's?"""
    rng = random.Random(7)
    shared = messages(rng, 400)[0]
    same = total = 0
    for i in range(n):
        chat = messages(rng, rng.randrange(5, 800))
        if i % 3 == 0:
            body: dict[str, Any] = {"prompt": chat[0]["content"] + " " + chat[1]["content"]}
        elif i % 3 == 1:
            body = {"messages": chat}
        else:
            body = {"messages": [shared, chat[1]]}
        async with session.post(url + "/tokenize", json={"model": engine.MODEL_NAME, **body}) as resp:
            theirs = (await resp.json())["tokens"]
        same += local.ids(body) == theirs
        total += 1
    return {"equal": same, "prompts": total}


def local_cost(local: LocalTokenizer, chars: int, shared: bool, calls: int = 50) -> dict[str, float]:
    """Time of the local tokenizer (template included) on chats of about `chars` characters, nearly all of them
    the system prompt: a new one each time, or one they all share (then its tokens are remembered)."""
    rng = random.Random(chars)
    words = chars // 3  # ~6.5 characters a word, half of them in the system turn
    system = messages(rng, words)[0]
    times, tokens = [], 0
    for _ in range(calls):
        chat = [system if shared else messages(rng, words)[0], {"role": "user", "content": "a short question"}]
        began = time.perf_counter()
        tokens = len(local.ids({"messages": chat}) or [])
        times.append(time.perf_counter() - began)
    times.sort()
    return {"chars": len(system["content"]), "tokens": tokens, "p50_ms": times[len(times) // 2] * 1e3,
            "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    server = engine.fresh_server("tokenize-cost", block_size=64, num_blocks=160, cpu=0)
    try:
        await asyncio.to_thread(server.wait_healthy)
        async with aiohttp.ClientSession() as session:
            await latency(session, server.url, 100, 20)  # warm-up
            result: dict[str, Any] = {"latency": {}, "cpu_ms_per_call": {}}
            for words in (450, 2200):
                result["latency"][words] = await latency(session, server.url, words, args.calls)
                result["cpu_ms_per_call"][words] = await cpu_per_call(session, server, words, args.calls) * 1e3
                engine.log(f"{words} words: {result['latency'][words]}, CPU/call "
                           f"{result['cpu_ms_per_call'][words]:.2f} ms")
            local = LocalTokenizer(engine.MODEL_DIR)
            result["local_agrees"] = await local_agrees(session, server.url, local, 100)
            result["local_cost"] = {f"{chars >> 10} KB, {'shared' if shared else 'new'}": local_cost(local, chars, shared)
                                    for chars in (4 << 10, 32 << 10) for shared in (False, True)}
            engine.log(f"local tokenizer: {result['local_agrees']}, {result['local_cost']}")
        runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
        await streams(server, 5.0, args.rate, False, 99)  # warm-up
        for rnd in range(args.rounds):
            for name in (("without", "with") if rnd % 2 == 0 else ("with", "without")):
                runs[name].append(await streams(server, args.phase_seconds, args.rate, name == "with", rnd))
                engine.log(f"round {rnd} {name} /tokenize: {runs[name][-1]}")
        result["traffic"] = runs
    finally:
        server.stop()
    return result


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# What a /tokenize call costs a real vLLM server (bench/tokenize_cost.py)", "",
             "| chat prompt | tokens | latency p50 | latency p99 | API-server CPU per call |", "|---|---:|---:|---:|---:|"]
    for words, lat in result["latency"].items():
        lines.append(f"| {words} words | {lat['tokens']:.0f} | {lat['p50_ms']:.2f} ms | {lat['p99_ms']:.2f} ms | "
                     f"{result['cpu_ms_per_call'][words]:.2f} ms |")
    agree = result["local_agrees"]
    lines += ["", f"The local tokenizer (`--tokenizer` on the model's directory) gave the server's ids for "
              f"{agree['equal']} of {agree['prompts']} prompts (completions and chats of 5-800 words, a third of "
              "the chats sharing one system prompt). Its cost, in the picker's decision (no call, no pod CPU), on "
              "chats that are nearly all system prompt, new each time or shared:", "",
              "| chat prompt | tokens | p50 | p99 |", "|---|---:|---:|---:|"]
    for name, cost in result["local_cost"].items():
        lines.append(f"| {name} ({cost['chars']:,} characters) | {cost['tokens']:.0f} | {cost['p50_ms']:.2f} ms | "
                     f"{cost['p99_ms']:.2f} ms |")
    lines += ["", f"Under traffic (open-loop streaming chats of ~1,070 tokens, {args.rate:g}/s, the same arrivals "
              f"for both, {args.phase_seconds:g} s phases, {args.rounds} rounds interleaved; TTFT counts the "
              "/tokenize call when there is one):", "",
              "| | requests | TTFT mean (per round) | ITL mean (per round) |", "|---|---:|---:|---:|"]
    for name, runs in result["traffic"].items():
        ttft = ", ".join(f"{r['ttft_mean_ms']:.1f}" for r in runs)
        itl = ", ".join(f"{r['itl_mean_ms']:.2f}" for r in runs if r["itl_mean_ms"])
        lines.append(f"| {name} /tokenize | {sum(r['requests'] for r in runs)} | {ttft} ms | {itl} ms |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=2.0, help="chats per second under traffic (default 2)")
    parser.add_argument("--out", default=str(engine.OUT))
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    engine.write_outputs(args.out, "tokenize_cost", result, report(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
