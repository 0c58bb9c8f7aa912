"""Data-parallel ranks behind one port, through real Envoy: two simulated vLLM servers of two ranks each
(`picker sim --data-parallel-size 2`) are four targets to the picker. Requests sharing a prefix reach the same rank
of the same server (the server's per-rank counters show every request named its rank, and the cache hits on the
rank that holds the prefix); a client's own rank header is overwritten; cold requests avoid the one rank that
traffic around the picker has queued up, and keep using its sibling behind the same port; the reference's
data-parallel config starts and routes the same servers rank by rank."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker_lab.supervisor import (
    Backends,
    Envoy,
    Managed,
    Picker,
    process_scope,
    start_envoy,
    start_picker,
    start_sim,
    wait_until,
)

REFERENCE_CONFIG = Path(__file__).resolve().parent / "data" / "reference_configs" / "data-parallel.yaml"


@dataclass
class DpStack:
    sim: Backends
    picker: Picker
    envoy: Envoy
    logdir: Path
    started: list[Managed]


def targets(picker: Picker) -> dict[str, picker_pb2.EndpointInfo]:
    with picker.channel() as channel:
        listed = picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
    return {e.address: e for e in listed.endpoints}


def rank_counters(address: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{address}/sim/ranks", timeout=5) as response:
        ranks: list[dict[str, Any]] = json.loads(response.read())["ranks"]
    return ranks


def picks_by_target(picker: Picker) -> dict[str, float]:
    """llm_d_epp_scheduler_attempts{status="success"} by endpoint_name: what the picker routed to each target."""
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.labels["endpoint_name"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "llm_d_epp_scheduler_attempts_total" and s.labels.get("status") == "success"}


@pytest.fixture(scope="module")
def dp() -> Iterator[DpStack]:
    with process_scope("data-parallel") as (logdir, started):
        sim = start_sim(2, logdir, time_scale=1.0,
                        extra=["--profile", "tiny-cpu", "--data-parallel-size", "2", "--max-num-seqs", "2"])
        started.append(sim.process)
        picker = start_picker(logdir, endpoints=sim.addresses, extra=["--metrics-slow-interval", "200ms"])
        started.append(picker.process)
        wanted = {f"{a}#{r}" for a in sim.addresses for r in (0, 1)}
        wait_until(lambda: set(targets(picker)) == wanted, 20, "the picker routes each rank", picker.process)
        envoy = start_envoy(logdir, picker, sim.addresses)
        started.append(envoy.process)
        yield DpStack(sim, picker, envoy, logdir, started)


async def complete(session: aiohttp.ClientSession, envoy: Envoy, prompt: str, max_tokens: int = 2,
                   headers: dict[str, str] | None = None) -> tuple[str, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(f"{envoy.url}/v1/completions", json=body, headers=headers or {}) as response:
        assert response.status == 200, await response.text()
        await response.read()
        return response.headers["x-sim-pod"], response.headers["x-sim-rank"]


async def test_requests_sharing_a_prefix_reach_the_same_rank(dp: DpStack) -> None:
    before = {a: rank_counters(a) for a in dp.sim.addresses}
    systems = [f"You are assistant {i} of the catalogue team. " * 30 for i in range(8)]
    sent = 0
    async with aiohttp.ClientSession() as session:
        home = {}
        for system in systems:
            home[system] = await complete(session, dp.envoy, system + "first question")
            sent += 1
        assert len(set(home.values())) >= 3  # the prefixes spread over the ranks, not only over the servers
        for turn in range(3):
            for system in systems:
                # a client naming a rank (here one no server has) is overwritten by the picker's pick
                headers = {"X-data-parallel-rank": "7"} if turn == 2 else None
                assert await complete(session, dp.envoy, system + f"question {turn}", headers=headers) \
                    == home[system], (system[:30], turn)
                sent += 1
    after = {a: rank_counters(a) for a in dp.sim.addresses}
    requests = sum(r["requests"] for a in after for r in after[a]) - sum(r["requests"] for a in before
                                                                          for r in before[a])
    steered = sum(r["steered"] for a in after for r in after[a]) - sum(r["steered"] for a in before for r in before[a])
    assert requests == steered == sent  # every request named its rank: none was balanced by the server
    # The picker's own counters name each rank (its identity "ip:port#rank"), and Explain says where a prompt goes
    picks = picks_by_target(dp.picker)
    assert set(picks) <= {f"{a}#{r}" for a in dp.sim.addresses for r in (0, 1)} and len(picks) >= 3, picks
    first_pod, first_rank = home[systems[0]]
    server = dp.sim.addresses[int(first_pod.removeprefix("sim-"))]
    async with dp.picker.aio_channel() as channel:
        explained = await picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
            path="/v1/completions", body=json.dumps({"model": "tiny", "prompt": systems[0] + "later"}).encode()))
    assert (explained.ranked[0], explained.destination, explained.data_parallel_rank) \
        == (f"{server}#{first_rank}", server, int(first_rank))
    homes = {(pod, int(rank)) for pod, rank in home.values()}
    for address in dp.sim.addresses:
        for rank in after[address]:
            new_hits = rank["prefix_cache_hits"] - before[address][rank["rank"]]["prefix_cache_hits"]
            pod = f"sim-{dp.sim.addresses.index(address)}"
            assert (new_hits > 0) == ((pod, rank["rank"]) in homes), (address, rank)


async def test_cold_requests_avoid_the_rank_queued_up_around_the_picker(dp: DpStack) -> None:
    busy_server = dp.sim.addresses[0]
    busy = f"{busy_server}#0"
    async with aiohttp.ClientSession() as session:

        async def around(i: int) -> None:  # straight to the server's rank 0, not through Envoy
            body = {"model": "tiny", "prompt": f"background job {i}", "max_tokens": 400, "ignore_eos": True}
            async with session.post(f"http://{busy_server}/v1/completions", json=body,
                                    headers={"X-data-parallel-rank": "0"}) as response:
                await response.read()

        background = [asyncio.create_task(around(i)) for i in range(10)]
        try:
            await asyncio.to_thread(wait_until, lambda: targets(dp.picker)[busy].waiting >= 5, 20,
                                    "the picker sees rank 0's queue")
            assert targets(dp.picker)[f"{busy_server}#1"].waiting == 0  # its sibling's own series: idle
            served = [await complete(session, dp.envoy, f"a cold prompt number {i} " * 5) for i in range(12)]
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    assert ("sim-0", "0") not in served, served
    assert ("sim-0", "1") in served, served  # the same server, the other rank: still used


async def test_the_reference_data_parallel_config_starts_and_routes_ranks(dp: DpStack) -> None:
    """The reference's deprecated data-parallel handler, its sample config unchanged: the picker starts, says what it
    runs instead, and routes the same servers rank by rank."""
    picker = start_picker(dp.logdir, endpoints=dp.sim.addresses, extra=["--config-file", str(REFERENCE_CONFIG)],
                          name="picker-reference")
    dp.started.append(picker.process)
    wanted = {f"{a}#{r}" for a in dp.sim.addresses for r in (0, 1)}
    await asyncio.to_thread(wait_until, lambda: set(targets(picker)) == wanted, 20, "ranks", picker.process)
    assert "data-parallel-profile-handler runs as single-profile-handler" in picker.process.log()
    envoy = start_envoy(dp.logdir, picker, dp.sim.addresses, name="envoy-reference")
    dp.started.append(envoy.process)
    async with aiohttp.ClientSession() as session:
        pod, rank = await complete(session, envoy, "a request under the reference's config")
    assert pod in ("sim-0", "sim-1") and rank in ("0", "1")
