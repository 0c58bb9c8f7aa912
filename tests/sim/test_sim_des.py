"""Fast mode: many engines in one discrete-event loop (no asyncio), and routing quality showing up in it.

This is also the reference for driving engines without the HTTP server: a heap of arrivals and engine step times.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from collections.abc import Callable

import aiohttp

from picker_lab.sim.engine import Engine, FinishedRequest, SimRequest
from picker_lab.sim.fleet import SimFleet
from picker_lab.sim.profiles import get_profile

Router = Callable[[int, int], int]  # (request index, prefix group) -> engine index


def simulate(router: Router, n_engines: int = 4, n_requests: int = 240, rate: float = 40.0) -> list[FinishedRequest]:
    profile = get_profile("llama3-8b-h100").with_overrides(num_gpu_blocks=1 + 700)
    engines = [Engine(profile, seed=7) for _ in range(n_engines)]
    rng = random.Random(3)
    groups = [[rng.randrange(1000, 100_000) for _ in range(2000)] for _ in range(8)]  # 2k-token system prompts
    arrivals: list[tuple[float, int, SimRequest, int]] = []
    t = 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate)
        g = rng.randrange(len(groups))
        prompt = groups[g] + [rng.randrange(1000, 100_000) for _ in range(100)]
        arrivals.append((t, i, SimRequest(f"r{i}", prompt, max_tokens=16), router(i, g)))
    arrivals.reverse()  # pop from the end in time order

    finished: list[FinishedRequest] = []
    steps: list[tuple[float, int]] = []  # heap of (next step time, engine index)
    scheduled = [False] * n_engines
    while arrivals or steps:
        next_arrival = arrivals[-1][0] if arrivals else float("inf")
        if steps and steps[0][0] <= next_arrival:
            now, k = heapq.heappop(steps)
            scheduled[k] = False
            result = engines[k].step(now)
            finished.extend(result.finished)
        else:
            now, _, req, k = arrivals.pop()
            engines[k].add_request(req, now)
        for k, engine in enumerate(engines):
            nxt = engine.next_step_time()
            if nxt is not None and not scheduled[k]:
                heapq.heappush(steps, (max(nxt, now), k))
                scheduled[k] = True
    return finished


def test_discrete_event_fleet_shows_prefix_affinity_beats_round_robin() -> None:
    t0 = time.perf_counter()
    rr = simulate(lambda i, g: i % 4)
    affinity = simulate(lambda i, g: g % 4)
    elapsed = time.perf_counter() - t0
    assert len(rr) == len(affinity) == 240
    assert all(f.finish_reason == "length" and len(f.output_token_ids) == 16 for f in rr + affinity)

    def mean_ttft(fins: list[FinishedRequest]) -> float:
        return sum(f.ttft or 0.0 for f in fins) / len(fins)

    hits_rr = sum(f.num_cached_tokens for f in rr)
    hits_aff = sum(f.num_cached_tokens for f in affinity)
    # 8 groups of 2k tokens do not fit one engine's 700 blocks x 16 tokens: round-robin thrashes every cache
    assert hits_aff > 1.5 * hits_rr
    assert mean_ttft(affinity) < mean_ttft(rr)
    assert elapsed < 20


async def test_time_scale_compresses_wall_time() -> None:
    body = {"prompt": "tell me a story", "max_tokens": 60}

    async def wall_and_model(scale: float) -> tuple[float, float]:
        async with SimFleet(1, profile="tiny-cpu", time_scale=scale) as fleet, aiohttp.ClientSession() as http:
            start = time.monotonic()
            async with http.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            wall = time.monotonic() - start
            hist = fleet.pods[0].metrics.h["vllm:e2e_request_latency_seconds"]
            return wall, hist.sum

    wall1, model1 = await wall_and_model(1.0)
    wall10, model10 = await wall_and_model(10.0)
    assert abs(model1 - model10) < 0.2 * model1  # same model time: 60 decode steps of ~3.7 ms
    assert wall1 >= 0.9 * model1
    assert wall10 < wall1 / 3
    await asyncio.sleep(0)
