"""A /metrics server on 127.0.0.1 that tests steer: a real vLLM page plus the queue gauges they set."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from picker.endpoints.metrics import only_named_samples
from picker.endpoints.state import Endpoint

IDLE_TEXT = (Path(__file__).resolve().parent / "data" / "vllm-0.32-cpu-idle.txt").read_text()  # read once


class FakePod:
    """A /metrics server whose behaviour a test flips: ok, error (503), hang, or down (socket closed). Like vLLM
    0.32 it answers `/metrics/?name[]=...` with only the samples named (`filter`: "names"), or refuses that URL
    ("refuse": 404, an exporter without the mount) or ignores the names ("ignore": another engine's page)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.filter = "names"
        self.waiting = 0
        self.running = 0
        self.queries = 0  # added to the page's prefix-cache queries counter (a restart: set it lower)
        self.hits = 0  # GETs of /metrics and /metrics/: scrapes
        self.filtered_hits = 0  # those of /metrics/
        self.last_page_bytes = 0
        self.tokenized = 0  # POST /tokenize calls
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "error":
            return web.Response(status=503, text="overloaded")
        if self.mode == "hang":
            await asyncio.sleep(10)
        text = IDLE_TEXT + f'vllm:num_requests_waiting{{engine="1",model_name="tiny"}} {self.waiting}\n' + \
            f'vllm:num_requests_running{{engine="1",model_name="tiny"}} {self.running}\n' + \
            f'vllm:prefix_cache_queries_total{{engine="1",model_name="tiny"}} {self.queries}\n'
        self.last_page_bytes = len(text)
        return web.Response(text=text, content_type="text/plain")

    async def _filtered(self, request: web.Request) -> web.StreamResponse:
        self.filtered_hits += 1
        if self.filter != "names":
            self.hits += 1
        if self.filter == "refuse":
            return web.Response(status=404, text="not found")
        if self.filter == "ignore":
            self.last_page_bytes = 0
            return web.Response(text="sglang:num_queue_reqs 0.0\n", content_type="text/plain")
        response = await self._metrics(request)
        assert isinstance(response, web.Response) and response.text is not None
        if response.status != 200:
            return response
        text = only_named_samples(response.text, request.query.getall("name[]", []))
        self.last_page_bytes = len(text)
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        """A word per token, its id the word's length (enough to tell prompts apart)."""
        self.tokenized += 1
        body = await request.json()
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
        return web.json_response({"tokens": [len(w) for w in text.split()], "count": len(text.split())})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._filtered)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        if not self.port:
            self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint.from_address(f"127.0.0.1:{self.port}")


@contextlib.asynccontextmanager
async def running_pods(count: int) -> AsyncIterator[list[FakePod]]:
    """`count` started pods, stopped on exit."""
    pods = [FakePod() for _ in range(count)]
    try:
        for pod in pods:
            await pod.start()
        yield pods
    finally:
        for pod in pods:
            await pod.stop()
