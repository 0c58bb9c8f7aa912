"""Metrics scraper against small aiohttp servers on 127.0.0.1: parsing, health transitions, slow pods."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from picker.endpoints.metrics import VLLM_READ_SERIES, only_named_samples, parse_vllm_metrics
from picker.endpoints.pool import EndpointPool
from picker.endpoints.scraper import Cadence, MetricsScraper, MetricsTarget
from picker.endpoints.state import Endpoint, EndpointMetrics, EndpointState
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


def watched_pool(pods: list[FakePod]) -> tuple[list[Endpoint], EndpointPool, list[tuple[str, str]]]:
    """The pods' endpoints in a pool, and the (event, address) pairs the pool emits from now on."""
    endpoints = [p.endpoint for p in pods]
    pool = EndpointPool()
    pool.set_endpoints(endpoints)
    events: list[tuple[str, str]] = []
    pool.subscribe(lambda event, e: events.append((event.value, e.address)))
    return endpoints, pool, events


async def test_pod_that_stops_answering_is_unready_within_two_polls_and_restored(pods: list[FakePod]) -> None:
    endpoints, pool, events = watched_pool(pods)
    scraper = MetricsScraper(pool.all, health=pool, timeout=1.0)
    victim = endpoints[0]
    try:
        await scraper.poll_once()
        await pods[0].stop()  # connection refused from now on, serving port included
        await scraper.poll_once()
        assert victim.healthy and victim.consecutive_failures == 1 and events == []
        await scraper.poll_once()
        assert victim.state is EndpointState.UNREADY and victim not in pool.ready()
        assert events == [("unready", victim.address)]
        assert all(e.state is EndpointState.READY for e in endpoints[1:])
        await scraper.poll_once()
        assert len(events) == 1  # reported once, not on every failed poll
        await pods[0].start()  # same port
        await scraper.poll_once()
        assert victim.state is EndpointState.READY and victim.consecutive_failures == 0
        assert events[1:] == [("ready", victim.address)]
    finally:
        await scraper.stop()


async def test_unreadable_metrics_of_a_reachable_pod_degrade_it_and_keep_it_routable(pods: list[FakePod]) -> None:
    """An HTTP error on /metrics (or a wrong metrics port) while the serving port answers: degraded, still in the
    ready set, scraped at the slow cadence; readable metrics make it ready again."""
    endpoints, pool, events = watched_pool(pods)
    scraper = MetricsScraper(pool.all, health=pool, timeout=1.0)
    victim = endpoints[1]
    try:
        await scraper.poll_once()
        pods[1].mode = "error"
        await scraper.poll_once()
        await scraper.poll_once()
        assert victim.state is EndpointState.DEGRADED and victim in pool.ready() and victim.healthy
        assert events == [("degraded", victim.address)]
        assert scraper.cadence.interval(victim, False) == scraper.cadence.slow
        assert victim.metrics.updated_at >= 0  # its last good metrics stay
        await scraper.poll_once()
        assert len(events) == 1
        await pods[1].stop()  # now it cannot be reached at all
        await scraper.poll_once()
        assert victim.state is EndpointState.UNREADY and victim not in pool.ready()
        pods[1].mode = "ok"
        await pods[1].start()
        await scraper.poll_once()
        assert victim.state is EndpointState.READY
        assert events == [("degraded", victim.address), ("unready", victim.address), ("ready", victim.address)]
    finally:
        await scraper.stop()


async def test_metrics_port_where_nothing_listens_degrades_every_pod(pods: list[FakePod]) -> None:
    endpoints, pool, _ = watched_pool(pods)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nothing = closed.getsockname()[1]
    scraper = MetricsScraper(pool.all, health=pool, timeout=1.0, target=MetricsTarget(port=nothing))
    try:
        await scraper.poll_once()
        await scraper.poll_once()
    finally:
        await scraper.stop()
    assert [e.state for e in endpoints] == [EndpointState.DEGRADED] * 3 and pool.ready() == endpoints


async def test_background_loop_hanging_pod_does_not_stall_the_others(pods: list[FakePod]) -> None:
    loop = asyncio.get_running_loop()
    pods[2].mode = "hang"
    endpoints, pool, events = watched_pool(pods)
    scraper = MetricsScraper(pool.all, refresh_interval=0.02, timeout=0.15, clock=loop.time, health=pool)
    await scraper.start()
    try:
        # Three more rounds of the loop (20 ms apart) while pod 2's first scrape hangs (0.15 s timeout): three
        # chances to start a second scrape of it.
        await eventually(lambda: pods[0].hits >= 4)
        hits_before = pods[0].hits
        assert pods[2].hits <= 2  # never re-scraped while a scrape of it is still running
        await eventually(lambda: events == [("degraded", endpoints[2].address)], 2.0)  # it accepts connections
        assert loop.time() - endpoints[0].metrics.updated_at < 0.1  # the healthy pods kept refreshing
        assert pods[0].hits > hits_before
        pods[2].mode = "ok"
        await eventually(lambda: events[-1] == ("ready", endpoints[2].address), 2.0)
        assert endpoints[2].state is EndpointState.READY
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


async def test_pods_that_join_together_are_first_scraped_spread_out() -> None:
    """A pool that starts with hundreds of pods does not scrape them all in one burst (which then recurs every
    interval): past FIRST_SCRAPES at once, the first scrapes are spaced over `fast` / FIRST_SCRAPES each."""
    from picker.endpoints.scraper import FIRST_SCRAPES

    many = [Endpoint.from_address(f"10.9.{i // 250}.{i % 250}:8000") for i in range(3 * FIRST_SCRAPES)]
    scraper = MetricsScraper(lambda: many, cadence=Cadence(fast=0.1, slow=1.0))
    scraper._sweep(50.0)
    due = sorted(scraper._due.values())
    assert due[0] == 50.0 and due[-1] == pytest.approx(50.0 + 0.1 * (3 * FIRST_SCRAPES - 1) / FIRST_SCRAPES)
    few = many[:FIRST_SCRAPES]
    scraper = MetricsScraper(lambda: few, cadence=Cadence(fast=0.1, slow=1.0))
    scraper._sweep(50.0)
    assert set(scraper._due.values()) == {50.0}  # a small pool is scraped at once


async def test_the_pool_is_read_once_per_fast_interval_not_once_per_scrape(pods: list[FakePod]) -> None:
    """Each finished scrape wakes the loop; the pool list is walked only every `fast` seconds (a pool of thousands
    of pods walked once per scrape cost a core)."""
    reads = 0

    def endpoints() -> list[Endpoint]:
        nonlocal reads
        reads += 1
        return [p.endpoint for p in pods]

    scraper = MetricsScraper(endpoints, cadence=Cadence(fast=0.2, slow=0.2), timeout=0.5)
    await scraper.start()
    try:
        await eventually(lambda: scraper.polls >= 4 * len(pods), 5.0)
    finally:
        await scraper.stop()
    assert reads <= scraper.polls / len(pods) + 3, (reads, scraper.polls)


async def test_a_scraper_told_of_the_pool_reads_it_only_when_pods_join_or_leave(pods: list[FakePod]) -> None:
    """Subscribed to the pool's events, the loop wakes for due scrapes and membership changes only: a pod that
    joins is scraped at once, one that leaves no more, and between them the pool is not read at all (ten reads a
    second were a third of an idle picker's CPU)."""
    reads = 0
    pool = EndpointPool()
    pool.set_endpoints([pods[0].endpoint])

    def endpoints() -> list[Endpoint]:
        nonlocal reads
        reads += 1
        return pool.all()

    scraper = MetricsScraper(endpoints, cadence=Cadence(fast=0.01, slow=0.05), timeout=0.5, subscribe=pool.subscribe)
    await scraper.start()
    try:
        await eventually(lambda: pods[0].hits >= 5, 2.0)  # 5 scrapes: 25 fast intervals, yet one read
        assert reads == 1
        pool.set_endpoints([pods[0].endpoint, pods[1].endpoint])  # joins between two scrapes of pods[0]
        await eventually(lambda: pods[1].hits > 0, 0.5)
        assert reads == 2
        pool.set_endpoints([pods[1].endpoint])
        await eventually(lambda: reads == 3, 0.5)
        frozen, rounds = pods[0].hits, pods[1].hits
        await eventually(lambda: pods[1].hits >= rounds + 3, 2.0)
        assert pods[0].hits <= frozen + 1 and reads == 3  # at most one scrape already in flight
    finally:
        await scraper.stop()


async def test_a_scrape_budget_stretches_every_interval_alike(pods: list[FakePod]) -> None:
    """Three pods at a fixed 20 ms ask for 150 scrapes a second; a budget of 30 stretches each interval five times
    (a large pool of busy pods would otherwise cost the picker a core), and says so."""
    loop = asyncio.get_running_loop()
    endpoints = [p.endpoint for p in pods]
    scraper = MetricsScraper(lambda: endpoints, refresh_interval=0.02, max_rate=30.0)
    await scraper.start()
    try:
        # each pod's interval is set as its scrape ends: stretched fully once every pod has asked
        await eventually(lambda: all(e.scrape_interval == pytest.approx(0.1) for e in endpoints), 2.0)
        assert scraper.stretch == pytest.approx(5.0)
        began, polls = loop.time(), scraper.polls
        await eventually(lambda: loop.time() - began >= 0.5, 2.0)
        assert scraper.polls - polls <= 0.5 * 30 * 1.5  # ~15 in half a second, not ~75
    finally:
        await scraper.stop()
    unlimited = MetricsScraper(lambda: endpoints, refresh_interval=0.02)
    try:
        await unlimited.poll_once()
        assert unlimited.stretch == 1.0 and endpoints[0].scrape_interval == pytest.approx(0.02)
    finally:
        await unlimited.stop()


async def test_a_vllm_pod_is_asked_for_only_the_series_read_and_others_for_the_whole_page(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's page is ~50 KB of which the picker reads a few series; asked for those by name (`/metrics/?name[]=`,
    as vLLM 0.32's exporter takes them) it renders ~1 KB. A pod that refuses that URL, or answers it without
    vLLM's queue gauge (another engine), is tried once and read whole from then on; with the filter off every
    pod is read whole. A pod failing with a 5xx fails the scrape and keeps the filter."""
    caplog.set_level(logging.INFO, logger="picker.endpoints.scraper")
    async with running_pods(4) as pods:
        pods[0].waiting = 3
        pods[1].filter, pods[1].waiting = "refuse", 4
        pods[2].filter, pods[2].waiting = "ignore", 5
        endpoints = [p.endpoint for p in pods]
        scraper = MetricsScraper(lambda: endpoints[:3])
        whole = MetricsScraper(lambda: endpoints[3:], target=MetricsTarget(only_read_series=False))
        try:
            for _ in range(3):
                await scraper.poll_once()
                await whole.poll_once()
        finally:
            await scraper.stop()
            await whole.stop()
        # (filtered URL asked, scrapes in all): the refusing and the ignoring pod each asked once, then whole
        assert [(p.filtered_hits, p.hits) for p in pods] == [(3, 3), (1, 4), (1, 4), (0, 3)]
        told = [r.getMessage() for r in caplog.records if "series filter" in r.getMessage()]
        assert len(told) == 2 and "HTTP 404" in told[0] + told[1]  # once a pod, with why
        assert [e.metrics.waiting for e in endpoints] == [3.0, 4.0, 5.0, 0.0]
        assert [e.healthy for e in endpoints] == [True] * 4 and scraper.failures == 0
        assert 0 < pods[0].last_page_bytes < pods[3].last_page_bytes / 20  # ~2 KB of ~55 KB
        pods[0].mode = "error"  # 503: the pod's failure, not the filter's
        scraper = MetricsScraper(lambda: endpoints[:1])
        try:
            await scraper.poll_once()
            pods[0].mode = "ok"
            await scraper.poll_once()
        finally:
            await scraper.stop()
        assert scraper.failures == 1 and (pods[0].filtered_hits, pods[0].hits) == (5, 5)
        assert endpoints[0].metrics.num_gpu_blocks == endpoints[3].metrics.num_gpu_blocks == 8192


@pytest.mark.parametrize("page", ["vllm-0.32-cpu-idle.txt", "vllm-0.32-cpu-lora.txt"])
def test_the_series_asked_for_are_every_one_the_parser_reads(page: str) -> None:
    """Real vLLM pages cut down to the series the scraper asks for read exactly as the whole pages do."""
    text = (Path(__file__).resolve().parent / "data" / page).read_text()
    filtered = only_named_samples(text, list(VLLM_READ_SERIES))
    assert len(filtered) < len(text) / 10
    assert parse_vllm_metrics(filtered) == parse_vllm_metrics(text)
