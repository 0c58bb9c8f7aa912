"""Metrics scraper against small aiohttp servers on 127.0.0.1: parsing, health transitions, slow pods."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.scraper import Cadence, MetricsScraper, MetricsTarget
from picker.endpoints.state import Endpoint, EndpointMetrics
from tests.fake_pod import FakePod, running_pods
from tests.waiting import eventually


@pytest.fixture
async def pods() -> AsyncIterator[list[FakePod]]:
    async with running_pods(3) as started:
        yield started


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
    assert endpoints[0].metrics.num_gpu_blocks == 8192 and endpoints[0].metrics.block_size == 128


async def test_pod_that_stops_answering_is_unhealthy_within_two_polls_and_restored(pods: list[FakePod]) -> None:
    endpoints = [p.endpoint for p in pods]
    down: list[str] = []
    up: list[str] = []
    pool = EndpointPool()
    pool.set_endpoints(endpoints)
    pool.subscribe(lambda event, e: (down if event is PoolEvent.UNREADY else up).append(e.address))
    scraper = MetricsScraper(pool.all, health=pool, timeout=1.0)
    victim = endpoints[0]
    try:
        await scraper.poll_once()
        await pods[0].stop()  # connection refused from now on
        await scraper.poll_once()
        assert victim.healthy and victim.consecutive_failures == 1 and down == []
        await scraper.poll_once()
        assert not victim.healthy and down == [victim.address] and victim not in pool.ready()
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
    pool = EndpointPool()
    pool.set_endpoints(endpoints)
    pool.subscribe(lambda event, e: (down if event is PoolEvent.UNREADY else up).append(e.address))
    scraper = MetricsScraper(pool.all, refresh_interval=0.02, timeout=0.15, clock=loop.time, health=pool)
    await scraper.start()
    try:
        # Three more rounds of the loop (20 ms apart) while pod 2's first scrape hangs (0.15 s timeout): three
        # chances to start a second scrape of it.
        await eventually(lambda: pods[0].hits >= 4)
        hits_before = pods[0].hits
        assert pods[2].hits <= 2  # never re-scraped while a scrape of it is still running
        await eventually(lambda: down == [endpoints[2].address], 2.0)
        assert loop.time() - endpoints[0].metrics.updated_at < 0.1  # the healthy pods kept refreshing
        assert pods[0].hits > hits_before
        pods[2].mode = "ok"
        await eventually(lambda: up == [endpoints[2].address], 2.0)
        assert endpoints[2].healthy
    finally:
        await scraper.stop()
    assert scraper._inflight == {}


async def test_endpoint_list_is_read_every_poll(pods: list[FakePod]) -> None:
    current = [pods[0].endpoint]
    scraper = MetricsScraper(lambda: current, refresh_interval=0.02)
    await scraper.start()
    try:
        await eventually(lambda: pods[0].hits > 0, 2.0)
        current = [pods[1].endpoint]  # discovery replaced the pool
        await eventually(lambda: pods[1].hits > 0, 2.0)
        frozen, rounds = pods[0].hits, pods[1].hits
        # Five more scrapes of the new pool: five chances to scrape the departed pod again.
        await eventually(lambda: pods[1].hits >= rounds + 5, 2.0)
        assert pods[0].hits <= frozen + 1  # at most one scrape that was already in flight
    finally:
        await scraper.stop()


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        MetricsScraper(list, refresh_interval=0)


def test_cadence_is_fast_only_while_a_pod_needs_watching() -> None:
    cadence = Cadence(fast=0.1, slow=1.0)
    calm = Endpoint.from_address("10.0.0.1:8000")
    calm.metrics = EndpointMetrics(running=2, updated_at=0.0)
    calm.in_flight = 2
    assert cadence.interval(calm, ok=True) == 1.0
    assert cadence.interval(calm, ok=False) == 0.1  # a failed scrape is retried soon: health needs it
    calm.metrics.waiting = 1
    assert cadence.interval(calm, ok=True) == 0.1  # queueing: near saturation
    calm.metrics.waiting, calm.metrics.kv_usage = 0, 0.75
    assert cadence.interval(calm, ok=True) == 0.1  # KV cache filling
    calm.metrics.kv_usage, calm.metrics.running = 0.1, 4
    assert cadence.interval(calm, ok=True) == 0.1  # runs 2 requests we did not route: traffic around us
    assert Cadence(fast=0.1, slow=1.0, compare_in_flight=False).interval(calm, ok=True) == 1.0
    assert Cadence.fixed(0.05).interval(calm, ok=True) == 0.05
    with pytest.raises(ValueError):
        Cadence(fast=2.0, slow=1.0)
    with pytest.raises(ValueError):
        MetricsScraper(list, refresh_interval=0.05, cadence=cadence)


async def test_calm_pods_are_scraped_at_the_slow_cadence_busy_ones_at_the_fast(pods: list[FakePod]) -> None:
    endpoints = [p.endpoint for p in pods]
    pods[1].waiting = 3
    seen: list[tuple[str, bool]] = []
    scraper = MetricsScraper(lambda: endpoints, cadence=Cadence(fast=0.02, slow=0.5),
                             on_scrape=lambda e, ok, _unreadable: seen.append((e.address, ok)))
    await scraper.start()
    try:
        await eventually(lambda: pods[1].hits >= 15, 5.0)
        assert pods[0].hits <= 2 and pods[2].hits <= 2  # 15 fast scrapes take ~0.3 s: one slow period
        assert endpoints[0].scrape_interval == 0.5 and endpoints[1].scrape_interval == 0.02
        assert (endpoints[1].address, True) in seen and all(ok for _, ok in seen)
        pods[1].waiting = 0  # the queue drained: back to the slow cadence
        await eventually(lambda: endpoints[1].scrape_interval == 0.5, 2.0)
        calm_hits = pods[1].hits
        pods[0].running = 5  # requests we never routed appear on pod 0: it is watched closely at once
        await eventually(lambda: pods[0].hits >= 10, 5.0)
        assert pods[1].hits <= calm_hits + 2
    finally:
        await scraper.stop()


async def test_metrics_are_read_where_the_target_says(pods: list[FakePod]) -> None:
    """--model-server-metrics-port/-path: one port for every pod (here the first pod's), another path."""
    endpoint = pods[1].endpoint
    scraper = MetricsScraper(lambda: [endpoint], target=MetricsTarget(port=pods[0].endpoint.port, path="/metrics"))
    pods[0].waiting, pods[1].waiting = 3, 9
    try:
        assert await scraper.scrape(endpoint)
        assert endpoint.metrics.waiting == 3.0  # read from the shared port, not the pod's serving port
        wrong = MetricsScraper(lambda: [endpoint], target=MetricsTarget(path="/no-metrics-here"))
        try:
            assert not await wrong.scrape(endpoint)
        finally:
            await wrong.stop()
    finally:
        await scraper.stop()
