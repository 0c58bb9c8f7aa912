"""Reading pods' GET /v1/models: the listing parsed defensively, read at start, re-read soon after a model swap,
and a pod that cannot answer keeps what was read before."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from picker.endpoints.model_listing import ModelListings, listed_models
from picker.endpoints.state import Endpoint, EndpointMetrics
from tests.waiting import eventually


def test_listing_parse() -> None:
    vllm = {"object": "list", "data": [{"id": "llama", "object": "model", "parent": None},
                                       {"id": "sql-lora", "object": "model", "parent": "llama"}]}
    assert listed_models(json.dumps(vllm).encode()) == {"llama", "sql-lora"}
    assert listed_models(b'{"data": [{"id": 3}, {"id": ""}, "x", {"id": "ok"}]}') == {"ok"}
    for garbage in (b"", b"[", b'{"data": 1}', b"[1]", b'{"data": [{"id": "' + b"x" * 600 + b'"}]}'):
        assert not listed_models(garbage)
    assert listed_models(b"[" * 100_000) is None


class Pod:
    def __init__(self) -> None:
        self.models = ["llama", "chat-lora"]
        self.status = 200
        self.reads = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.reads += 1
        if self.status != 200:
            return web.json_response({"error": "no"}, status=self.status)
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})


@pytest.fixture
async def pod_server() -> AsyncIterator[tuple[Pod, Endpoint]]:
    pod = Pod()
    app = web.Application()
    app.router.add_get("/v1/models", pod.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    endpoint = Endpoint.from_address(f"127.0.0.1:{port}")
    endpoint.metrics = EndpointMetrics(models=frozenset({"llama"}), updated_at=0.0)
    yield pod, endpoint
    await runner.cleanup()


async def test_read_at_start_kept_on_failure_and_reread_after_a_swap(pod_server: tuple[Pod, Endpoint]) -> None:
    pod, endpoint = pod_server
    listings = ModelListings(lambda: [endpoint], interval=3600)
    task = asyncio.create_task(listings.run())
    try:
        await eventually(lambda: endpoint.listing() == {"llama", "chat-lora"})
        assert pod.reads == 1  # the next round is an hour away
        pod.status, pod.models = 401, ["qwen"]  # an API key in front of it now: what was read stays
        endpoint.metrics = EndpointMetrics(models=frozenset({"qwen"}), updated_at=0.0)  # and it swapped
        assert endpoint.listing() == frozenset()  # not believed once its metrics name another model
        await eventually(lambda: pod.reads >= 2, within=3)  # re-read within about a second
        assert endpoint.listed_models == {"llama", "chat-lora"}  # the failed read kept the old one
        pod.status = 200
        await eventually(lambda: endpoint.listing() == {"qwen"}, within=4)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
