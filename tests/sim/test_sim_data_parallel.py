"""`picker sim --data-parallel-size N`: N engines behind one port, as vLLM runs them: the rank a request names in
X-data-parallel-rank serves it, the others are balanced, one metrics page labels each engine's series."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from picker.cli import main
from picker.core.requests import ApiKind, InferenceRequest
from picker.endpoints.metrics import parse_metrics
from picker.endpoints.model_listing import ModelListings
from picker.endpoints.state import Endpoint
from picker.prefix.tokens import PodTokenizer
from picker_lab.sim.data_parallel import DataParallelPod
from picker_lab.sim.fleet import SimFleet


@pytest.fixture
async def server() -> AsyncIterator[tuple[DataParallelPod, str]]:
    async with SimFleet(1, profile="tiny-cpu", time_scale=50.0, data_parallel_size=3) as fleet:
        pod = fleet.pods[0]
        assert isinstance(pod, DataParallelPod)
        yield pod, fleet.urls[0]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str,
                   headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, object]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        return resp.status, resp.headers.get("x-sim-rank", ""), await resp.json()


async def test_the_named_rank_serves_and_caches_the_prompt(server: tuple[DataParallelPod, str]) -> None:
    pod, url = server
    prompt = "the same long system prompt for every turn " * 30
    async with aiohttp.ClientSession() as session:
        for turn in range(3):
            status, rank, body = await complete(session, url, prompt + f" turn {turn}", {"X-data-parallel-rank": "2"})
            assert (status, rank) == (200, "2")
        async with session.get(f"{url}/sim/ranks") as resp:
            ranks = (await resp.json())["ranks"]
        status, _, error = await complete(session, url, prompt, {"x-data-parallel-rank": "3"})
        assert status == 400 and "out of range" in str(error)
    assert [r["requests"] for r in ranks] == [0, 0, 3] and ranks[2]["steered"] == 3
    assert ranks[2]["prefix_cache_hits"] > 0 and ranks[0]["prefix_cache_queries"] == 0
    usage = body["usage"]
    assert isinstance(usage, dict) and usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_requests_without_the_header_are_spread_and_the_page_labels_each_engine(
        server: tuple[DataParallelPod, str]) -> None:
    pod, url = server
    async with aiohttp.ClientSession() as session:
        served = [(await complete(session, url, f"prompt {i}", {"X-data-parallel-rank": "x"}))[1] for i in range(6)]
        async with session.get(f"{url}/metrics") as resp:
            page = await resp.text()
    assert sorted(served) == ["0", "0", "1", "1", "2", "2"]  # idle engines: the rotating start spreads ties
    assert pod.steered == [0, 0, 0]  # a value that is no integer is ignored, as vLLM does
    m = parse_metrics(page)
    assert m.engines is not None and sorted(m.engines) == [0, 1, 2]
    assert page.count("# TYPE vllm:num_requests_waiting gauge") == 1  # each family once


async def test_a_ranks_model_listing_and_token_ids_are_its_servers(server: tuple[DataParallelPod, str]) -> None:
    """What the picker asks a rank's server for (GET /v1/models, POST /tokenize) goes to the server's ip:port."""
    _, url = server
    rank = Endpoint.rank_of(Endpoint.from_address(url.removeprefix("http://")), 1)
    async with aiohttp.ClientSession() as session:
        assert await ModelListings(lambda: [rank], session=session).read(rank)
    assert "tiny" in rank.listed_models
    tokenizer = PodTokenizer(timeout=5.0)
    try:
        request = InferenceRequest(request_id="t", model="tiny", api=ApiKind.COMPLETIONS, path="/v1/completions",
                                   prompt_text="hello there", parsed={"model": "tiny", "prompt": "hello there"})
        ids = await tokenizer.token_ids(request, lambda: [rank])
    finally:
        await tokenizer.close()
    assert ids


@pytest.mark.parametrize("flags", [["--engine", "sglang"], ["--kv-events-endpoint-base", "tcp://127.0.0.1:5557"],
                                   ["--pods", "2", "--kv-events-replay-port-base", "5600"]])
def test_a_data_parallel_pod_refuses_what_its_ranks_ports_would_break(capsys: pytest.CaptureFixture[str],
                                                                      flags: list[str]) -> None:
    # vLLM's metrics only; each rank publishes on a port of its own (+ its rank): numbered per pod, they collide
    assert main(["sim", "--data-parallel-size", "2", "--base-port", "0", *flags]) == 2
    assert "--data-parallel-size" in capsys.readouterr().err
