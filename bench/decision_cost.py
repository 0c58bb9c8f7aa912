"""Decision cost of the pure scheduling core: schedule() + on_picked() latency, hashing, index memory.

Run: .venv/bin/python bench/decision_cost.py [--iterations N]. Prints markdown tables. Everything is
in-process and single-threaded; numbers are wall-clock per call (time.perf_counter_ns).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from picker.core.requests import InferenceRequest  # noqa: E402
from picker.endpoints.metrics import VLLM_READ_SERIES, only_named_samples, parse_vllm_metrics  # noqa: E402
from picker.endpoints.state import Endpoint  # noqa: E402
from picker.prefix.hashing import prefix_keys, prefix_seed  # noqa: E402
from picker.prefix.memory import InMemoryPrefixIndex  # noqa: E402
from picker.scheduling.config import build_scheduler  # noqa: E402
from picker_lab.bench.configs import PREDICTED_TTFT_CONFIG, predicted_ttft_scheduling  # noqa: E402
from picker_lab.bench.scale import simulated_pods, words_text  # noqa: E402

text = words_text
endpoints = simulated_pods


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    arr = np.array(samples_ns, dtype=np.float64) / 1000.0
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def bench_schedule(n_endpoints: int, prompt_chars: int, iterations: int, explain: bool,
                   scheduling: dict[str, Any] | None = None) -> tuple[float, float, float]:
    """p50/p99 µs of schedule()+on_picked() on a workload of 32 shared prefixes (75 %) + unique tails, with the
    default scheduling config or `scheduling`."""
    rng = random.Random(n_endpoints * 7919 + prompt_chars)
    pool = endpoints(n_endpoints, rng)
    scheduler = build_scheduler({**(scheduling or {}), "explain": explain}, rng=random.Random(1))
    prefixes = [text(rng, prompt_chars * 3 // 4) for _ in range(32)]
    prompts = [rng.choice(prefixes) + text(rng, prompt_chars // 4) for _ in range(256)]
    in_flight: list[tuple[Endpoint, int]] = []
    samples: list[int] = []
    matched = 0
    gc.collect()
    for i in range(iterations + 200):
        request = InferenceRequest(f"r{i}", "llama", prompt_text=prompts[i % len(prompts)],
                                   session_id=f"s{i % 97}" if i % 3 == 0 else None)
        now = i * 0.001
        t0 = time.perf_counter_ns()
        result = scheduler.schedule(request, pool, now)
        chosen = result.ranked[0]
        assert result.context is not None
        scheduler.on_picked(result.context, chosen, now)
        t1 = time.perf_counter_ns()
        chosen.start_request(prompt_chars // 4, now)
        in_flight.append((chosen, prompt_chars // 4))
        if len(in_flight) > 4 * n_endpoints:  # keep a steady in-flight population
            e, tok = in_flight.pop(rng.randrange(len(in_flight)))
            e.finish_request(tok)
        if i >= 200:  # warm-up: the index fills first
            samples.append(t1 - t0)
            matched += result.prefix_matched_blocks > 0
    p50, p99 = percentiles(samples)
    return p50, p99, matched / iterations


def bench_hashing(chars: int, iterations: int, block_chars: int = 64) -> tuple[float, float, int]:
    rng = random.Random(5)
    prompt = text(rng, chars)
    seed = prefix_seed("llama")
    samples = []
    keys: list[int] = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        keys = prefix_keys(prompt, seed, block_chars, 256)
        samples.append(time.perf_counter_ns() - t0)
    p50, p99 = percentiles(samples)
    return p50, p99, len(keys)


def index_bytes_per_entry(entries: int, endpoints_n: int, sharing: float) -> float:
    """tracemalloc bytes per (endpoint, block) entry, key ints included (the index keeps them alive)."""
    rng = random.Random(9)
    addresses = [f"10.0.0.{i}:8000" for i in range(endpoints_n)]
    index = InMemoryPrefixIndex(default_capacity=entries, ttl=None)  # no expiry while filling
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    chains = 0
    while index.size() < entries:
        keys = prefix_keys(f"chain {chains} " + "x" * 16_000, prefix_seed("m"), 64, 256)
        index.record(keys, rng.choice(addresses), float(chains))
        if rng.random() < sharing:  # the same prefix also cached on a second pod
            index.record(keys, rng.choice(addresses), float(chains))
        chains += 1
        del keys
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / index.size()


def bench_metrics_parse(iterations: int, only_read_series: bool = False) -> tuple[float, float] | None:
    """Parsing a real vLLM page: the whole page, or the page vLLM answers when asked for the series we read."""
    path = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm-0.32-cpu-idle.txt"
    if not path.exists():
        return None
    body = path.read_text()
    if only_read_series:
        body = only_named_samples(body, list(VLLM_READ_SERIES))
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        parse_vllm_metrics(body, 0.0)
        samples.append(time.perf_counter_ns() - t0)
    return percentiles(samples)


def bench_parse_image_chat(iterations: int) -> tuple[float, float, int]:
    """build_request on a chat carrying a ~100 KB PNG as a data URL (decoded, hashed, its size read): p50, p99, body
    bytes."""
    import base64
    import json
    import struct
    import zlib

    from picker.core.requests import build_request

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1280, 960, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", random.Random(0).randbytes(100_000)) + chunk(b"IEND", b""))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}]}]}
    ).encode()
    headers = {":path": "/v1/chat/completions", ":method": "POST"}
    samples = []
    for _ in range(iterations):
        began = time.perf_counter_ns()
        build_request(headers, body, request_id="r")
        samples.append(time.perf_counter_ns() - began)
    p50, p99 = percentiles(samples)
    return p50, p99, len(body)


def bench_numpy_vs_python(n: int, iterations: int) -> tuple[float, float]:
    """KV + queue scoring for n endpoints: plain loops vs numpy (attribute extraction included)."""
    pool = endpoints(n, random.Random(3))

    def python_scores() -> list[float]:
        waits = [e.metrics.waiting for e in pool]
        lo, hi = min(waits), max(waits)
        span = hi - lo or 1.0
        return [(1.0 - e.metrics.kv_usage) + (hi - w) / span for e, w in zip(pool, waits, strict=True)]

    def numpy_scores() -> np.ndarray:
        waits = np.fromiter((e.metrics.waiting for e in pool), dtype=np.float64, count=n)
        kv = np.fromiter((e.metrics.kv_usage for e in pool), dtype=np.float64, count=n)
        span = (waits.max() - waits.min()) or 1.0
        return (1.0 - kv) + (waits.max() - waits) / span

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        return (time.perf_counter_ns() - t0) / iterations / 1000.0

    return timed(python_scores), timed(numpy_scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    it = args.iterations
    started = time.perf_counter()
    print(f"Python {sys.version.split()[0]}, {it} decisions per cell, default config (explain on)\n")
    print("| endpoints | prompt | schedule+on_picked p50 (µs) | p99 (µs) | requests with a prefix hit | p50 explain off (µs) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (8, 64, 512):
        for chars in (1024, 32 * 1024):
            cell_it = it if n < 512 else max(200, it // 4)
            p50, p99, hit = bench_schedule(n, chars, cell_it, explain=True)
            q50, _, _ = bench_schedule(n, chars, cell_it, explain=False)
            print(f"| {n} | {chars // 1024} KB | {p50:.0f} | {p99:.0f} | {hit:.0%} | {q50:.0f} |")
    print("\n| cost | p50 | p99 |\n|---|---:|---:|")
    for block_chars in (64, 512):
        h50, h99, blocks = bench_hashing(32 * 1024, it, block_chars)
        print(f"| hash a 32 KB prompt: {blocks} blocks of {block_chars} chars | {h50:.1f} µs | {h99:.1f} µs |")
    parse = bench_metrics_parse(it)
    if parse is not None:
        print(f"| parse one vLLM /metrics (55 KB) | {parse[0]:.0f} µs | {parse[1]:.0f} µs |")
    parse = bench_metrics_parse(it, only_read_series=True)
    if parse is not None:
        print(f"| parse the same page as asked for by default (the series read, ~2 KB) | {parse[0]:.0f} µs | "
              f"{parse[1]:.0f} µs |")
    i50, i99, size = bench_parse_image_chat(it)
    print(f"| parse a chat carrying a 100 KB image ({size // 1024} KB body) | {i50:.0f} µs | {i99:.0f} µs |")
    print("\n| prefix index | bytes per (endpoint, block) entry |\n|---|---:|")
    for entries, eps, sharing in ((100_000, 8, 0.0), (100_000, 8, 0.5), (400_000, 64, 0.2)):
        bpe = index_bytes_per_entry(entries, eps, sharing)
        print(f"| {entries:,} entries, {eps} endpoints, {sharing:.0%} prefixes on 2 pods | {bpe:.0f} |")
    print("\n| KV+queue scoring | python loop (µs) | numpy incl. extraction (µs) |\n|---:|---:|---:|")
    for n in (8, 64, 512):
        py, npy = bench_numpy_vs_python(n, 2000)
        print(f"| {n} endpoints | {py:.1f} | {npy:.1f} |")
    no_demand = predicted_ttft_scheduling(demandWindowSeconds=0)
    print("\n| endpoints | prompt | defaults p50 / p99 (µs) | predicted TTFT p50 / p99 (µs) | p50 ratio | "
          "predicted TTFT without copy demand p50 / p99 (µs) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (8, 64):
        for chars in (1024, 32 * 1024):
            d50, d99, _ = bench_schedule(n, chars, it, explain=True)
            p50, p99, _ = bench_schedule(n, chars, it, explain=True, scheduling=PREDICTED_TTFT_CONFIG)
            n50, n99, _ = bench_schedule(n, chars, it, explain=True, scheduling=no_demand)
            print(f"| {n} | {chars // 1024} KB | {d50:.0f} / {d99:.0f} | {p50:.0f} / {p99:.0f} | {p50 / d50:.2f} | "
                  f"{n50:.0f} / {n99:.0f} |")
    print(f"\n(total bench time {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
