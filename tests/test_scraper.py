"""Metrics scraper against small aiohttp servers on 127.0.0.1: parsing, health transitions, slow pods."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from picker.endpoints.scraper import MetricsScraper
from picker.endpoints.state import Endpoint

_IDLE = Path("/work/shared/data/vllm-metrics/vllm-0.32-cpu-idle.txt")
IDLE_TEXT = _IDLE.read_text() if _IDLE.exists() else ""  # read once: handlers must not block


class FakePod:
    """A /metrics server whose behaviour a test flips: ok, error (503), hang, or down (socket closed)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.waiting = 0
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "error":
            return web.Response(status=503, text="overloaded")
        if self.mode == "hang":
            await asyncio.sleep(10)
        text = IDLE_TEXT + f'vllm:num_requests_waiting{{engine="1",model_name="tiny"}} {self.waiting}\n'
        return web.Response(text=text, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
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


@pytest.fixture
async def pods() -> AsyncIterator[list[FakePod]]:
    started = [FakePod() for _ in range(3)]
    for pod in started:
        await pod.start()
    yield started
    for pod in started:
        await pod.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_poll_updates_metrics_with_injected_clock(pods: list[FakePod]) -> None:
    endpoints = [p.endpoint for p in pods]
    pods[1].waiting = 7
    clock = Clock()
    scraper = MetricsScraper(lambda: endpoints, clock=clock)
    try:
        await scraper.poll_once()
    finally:
        await scraper.stop()
    assert [e.metrics.updated_at for e in endpoints] == [100.0] * 3
    assert [e.metrics.waiting for e in endpoints] == [0.0, 7.0, 0.0]  # engine "1" series summed in
    if IDLE_TEXT:
        assert endpoints[0].metrics.num_gpu_blocks == 8192 and endpoints[0].metrics.block_size == 128


async def test_pod_that_stops_answering_is_unhealthy_within_two_polls_and_restored(pods: list[FakePod]) -> None:
    endpoints = [p.endpoint for p in pods]
    down: list[str] = []
    up: list[str] = []
    scraper = MetricsScraper(lambda: endpoints, on_unhealthy=lambda e: down.append(e.address),
                             on_healthy=lambda e: up.append(e.address), timeout=1.0)
    victim = endpoints[0]
    try:
        await scraper.poll_once()
        await pods[0].stop()  # connection refused from now on
        await scraper.poll_once()
        assert victim.healthy and victim.consecutive_failures == 1 and down == []
        await scraper.poll_once()
        assert not victim.healthy and down == [victim.address]
        assert all(e.healthy for e in endpoints[1:])
        await scraper.poll_once()
        assert down == [victim.address]  # reported once, not on every failed poll
        await pods[0].start()  # same port
        await scraper.poll_once()
        assert victim.healthy and victim.consecutive_failures == 0 and up == [victim.address]
        pods[1].mode = "error"  # an HTTP error counts as a failed poll too
        await scraper.poll_once()
        await scraper.poll_once()
        assert not endpoints[1].healthy and down == [victim.address, endpoints[1].address]
    finally:
        await scraper.stop()


async def test_background_loop_hanging_pod_does_not_stall_the_others(pods: list[FakePod]) -> None:
    endpoints = [p.endpoint for p in pods]
    loop = asyncio.get_running_loop()
    down: list[str] = []
    up: list[str] = []
    pods[2].mode = "hang"
    scraper = MetricsScraper(lambda: endpoints, refresh_interval=0.02, timeout=0.15, clock=loop.time,
                             on_unhealthy=lambda e: down.append(e.address), on_healthy=lambda e: up.append(e.address))
    await scraper.start()
    try:
        await asyncio.sleep(0.25)
        hits_before = pods[0].hits
        assert pods[2].hits <= 2  # never re-scraped while a scrape of it is still running
        await _until(lambda: down == [endpoints[2].address], 2.0)
        assert loop.time() - endpoints[0].metrics.updated_at < 0.1  # the healthy pods kept refreshing
        assert pods[0].hits > hits_before
        pods[2].mode = "ok"
        await _until(lambda: up == [endpoints[2].address], 2.0)
        assert endpoints[2].healthy
    finally:
        await scraper.stop()
    assert scraper._inflight == {}


async def test_endpoint_list_is_read_every_poll(pods: list[FakePod]) -> None:
    current = [pods[0].endpoint]
    scraper = MetricsScraper(lambda: current, refresh_interval=0.02)
    await scraper.start()
    try:
        await _until(lambda: pods[0].hits > 0, 2.0)
        current = [pods[1].endpoint]  # discovery replaced the pool
        await _until(lambda: pods[1].hits > 0, 2.0)
        frozen = pods[0].hits
        await asyncio.sleep(0.1)
        assert pods[0].hits <= frozen + 1  # at most one scrape that was already in flight
    finally:
        await scraper.stop()


async def _until(condition: Callable[[], bool], limit: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        MetricsScraper(list, refresh_interval=0)
