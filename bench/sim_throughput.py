"""How many requests/s one `picker sim --pods N` process sustains at time-scale 1 (bounded run, <= ~60 s).

Starts `picker sim` as a subprocess (so the client load runs in this process, as it would in a benchmark), then
drives it with closed-loop aiohttp clients at increasing concurrency, round-robin over the pods. For each phase it
reports completed requests/s, client-side latency percentiles, the sim process's CPU use, and how far the
wall-clock latency drifts from the model's own e2e latency (read from the pods' /metrics): when the sim process is
CPU-bound, steps start late and the measured latency exceeds the model latency.

    .venv/bin/python bench/sim_throughput.py [--pods 16] [--phase-seconds 11] [--concurrency 32 128 256 384]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.supervisor import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega", "router", "cache", "prefix", "token"]


def prompt(group: int, i: int, chars: int) -> str:
    """A shared system-prompt-like prefix per group plus a unique question."""
    prefix = " ".join(WORDS[(group * 7 + k) % len(WORDS)] + str(group) for k in range(chars // 8))
    return f"{prefix}\nQuestion {i}: what about {WORDS[i % len(WORDS)]} number {i}?"


async def model_e2e(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """Sum and count of vllm:e2e_request_latency_seconds over the pods (model time)."""
    total = count = 0.0
    for url in urls:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        for fam in text_string_to_metric_families(text):
            if fam.name == "vllm:e2e_request_latency_seconds":
                for s in fam.samples:
                    if s.name.endswith("_sum"):
                        total += s.value
                    elif s.name.endswith("_count"):
                        count += s.value
    return total, count


async def phase(urls: list[str], concurrency: int, seconds: float, args: argparse.Namespace, pid: int) -> dict:
    latencies: list[float] = []
    errors = 0
    counter = itertools.count()
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        sum0, cnt0 = await model_e2e(http, urls)
        cpu0 = cpu_seconds(pid)
        t0 = time.monotonic()

        async def client() -> None:
            nonlocal errors
            while time.monotonic() < deadline:
                i = next(counter)
                body = {"prompt": prompt(i % args.groups, i, args.prompt_chars), "max_tokens": args.max_tokens,
                        "ignore_eos": True}  # fmt: skip
                start = time.monotonic()
                try:
                    async with http.post(urls[i % len(urls)] + "/v1/completions", json=body) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors += 1
                            continue
                except aiohttp.ClientError:
                    errors += 1
                    continue
                latencies.append(time.monotonic() - start)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
        cpu1 = cpu_seconds(pid)
        sum1, cnt1 = await model_e2e(http, urls)
    latencies.sort()
    n = len(latencies)
    model_mean = (sum1 - sum0) / (cnt1 - cnt0) if cnt1 > cnt0 else float("nan")
    return {
        "concurrency": concurrency,
        "requests": n,
        "errors": errors,
        "rps": n / elapsed,
        "p50": latencies[n // 2] if n else float("nan"),
        "p99": latencies[min(n - 1, int(n * 0.99))] if n else float("nan"),
        "mean": statistics.fmean(latencies) if n else float("nan"),
        "model_mean": model_mean,
        "sim_cpu": (cpu1 - cpu0) / elapsed,
    }


async def main_async(args: argparse.Namespace, proc: subprocess.Popen[str], urls: list[str]) -> int:
    print(f"# picker sim --pods {args.pods} --profile {args.profile} --time-scale 1 (pid {proc.pid}); "
          f"prompts ~{args.prompt_chars} chars in {args.groups} prefix groups, max_tokens {args.max_tokens}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print("| concurrency | completed req/s | p50 s | p99 s | client mean s | model e2e mean s | sim CPU | errors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        r = await phase(urls, c, args.phase_seconds, args, proc.pid)
        print(f"| {r['concurrency']} | {r['rps']:.1f} | {r['p50']:.3f} | {r['p99']:.3f} | {r['mean']:.3f} | "
              f"{r['model_mean']:.3f} | {r['sim_cpu']:.0%} | {r['errors']} |", flush=True)  # fmt: skip
    return 0


def run_bounded(args: argparse.Namespace) -> int:
    """Start the sim process, measure, always stop it."""
    cmd = [sys.executable, "-m", "picker.cli", "sim", "--pods", str(args.pods), "--base-port", "0",
           "--profile", args.profile, "--time-scale", "1"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().split()[1] for _ in range(args.pods)]
        return asyncio.run(main_async(args, proc, urls))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--phase-seconds", type=float, default=11.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 128, 256, 384])
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.phase_seconds * len(args.concurrency) > 55:
        parser.error("keep the run bounded: phase-seconds x phases must stay under 55 s")
    return run_bounded(args)


if __name__ == "__main__":
    sys.exit(main())
