"""A pool serving two models through real Envoy: every request lands on a pod that serves its model, an adapter
on the pod running it (or listing it loaded at /v1/models), a model nothing serves is the picker's 404 `model_not_found`, `GET /v1/models` lists the
pool's union, and a pod that swaps its model is followed once a scrape shows it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from picker_lab.supervisor import (
    Backends,
    Envoy,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_picker_fleet,
)
from tests.waiting import eventually_async


@dataclass
class TwoModels:
    pods: Backends
    envoy: Envoy


@pytest.fixture(scope="module")
def two_models() -> Iterator[TwoModels]:
    with process_scope("two-models") as (logdir, started):
        pods = start_backends(4, logdir)
        started.append(pods.process)
        for i, address in enumerate(pods.addresses):
            set_echo_metrics(address, models=["llama" if i < 2 else "qwen"],
                             running_loras=["sql-lora"] if i == 3 else [],
                             adapters=["chat-lora"] if i == 1 else [])  # loaded, idle: only /v1/models says
        fleet = start_picker_fleet(logdir, pods.addresses, flags=["--metrics-fast-interval", "50ms",
                                                                 "--metrics-slow-interval", "100ms"])
        started.extend(fleet.processes)
        yield TwoModels(pods, fleet.envoy)


async def served_by(session: aiohttp.ClientSession, envoy: Envoy, model: str, text: str) -> tuple[int, object]:
    async with session.post(envoy.url + "/v1/completions", json={"model": model, "prompt": text}) as response:
        body = await response.json(content_type=None)
        return response.status, body.get("served_by") if response.status == 200 else body


async def test_each_model_goes_only_to_its_pods_and_an_unknown_one_is_404(two_models: TwoModels) -> None:
    llama, qwen = set(two_models.pods.addresses[:2]), set(two_models.pods.addresses[2:])
    async with aiohttp.ClientSession() as session:

        async def learned() -> bool:
            status, _ = await served_by(session, two_models.envoy, "qwen", "warm")
            return status == 200
        await eventually_async(learned, "the pods' models scraped", within=10)
        results = await asyncio.gather(*(served_by(session, two_models.envoy, model, f"{model} question {i} " * 8)
                                         for i in range(20) for model in ("llama", "qwen")))
        lora = [await served_by(session, two_models.envoy, "sql-lora", f"lora {i}") for i in range(5)]
        idle = [await served_by(session, two_models.envoy, "chat-lora", f"idle {i}") for i in range(5)]
        status, error = await served_by(session, two_models.envoy, "mistral", "nobody serves me")
        async with session.get(two_models.envoy.url + "/v1/models") as response:
            listed = await response.json()
    by_model: dict[str, set[object]] = {"llama": set(), "qwen": set()}
    for (code, pod), model in zip(results, [m for _ in range(20) for m in ("llama", "qwen")], strict=True):
        assert code == 200
        by_model[model].add(pod)
    assert by_model["llama"] <= llama and by_model["qwen"] <= qwen  # zero misrouted
    assert {pod for _, pod in lora} == {two_models.pods.addresses[3]}
    assert {pod for _, pod in idle} == {two_models.pods.addresses[1]}  # where it is loaded, though idle
    assert status == 404 and error["error"]["code"] == "model_not_found"  # type: ignore[index]
    assert "chat-lora, llama, qwen, sql-lora" in error["error"]["message"]  # type: ignore[index]
    assert [m["id"] for m in listed["data"]] == ["chat-lora", "llama", "qwen", "sql-lora"]  # the pool's union


async def test_a_pod_that_swaps_its_model_is_followed(two_models: TwoModels) -> None:
    first = two_models.pods.addresses[0]
    set_echo_metrics(first, models=["qwen"])
    try:
        async with aiohttp.ClientSession() as session:

            tries = iter(range(10_000))

            async def swapped() -> bool:
                n = next(tries)
                pods = {pod for _, pod in await asyncio.gather(*(
                    served_by(session, two_models.envoy, "qwen", f"swap {n} {j}") for j in range(6)))}
                return first in pods
            await eventually_async(swapped, "qwen routed to the pod that now serves it", within=10)
            llama = {pod for _, pod in await asyncio.gather(*(served_by(session, two_models.envoy, "llama", f"l {i}")
                                                               for i in range(10)))}
        assert llama == {two_models.pods.addresses[1]}
    finally:
        set_echo_metrics(first, models=["llama"])
