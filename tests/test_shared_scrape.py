"""Replicas sharing scrapes through a real valkey-server: one scrape per pod per cadence, however many replicas."""

from __future__ import annotations

import math
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.scraper import Cadence, MetricsScraper, started_over
from picker.endpoints.shared_scrape import SharedSample, SharedScrapes, _decode, _encode
from picker.endpoints.state import Endpoint, EndpointMetrics, EndpointState
from picker_lab.supervisor import (
    Envoy,
    Picker,
    Valkey,
    free_port,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_envoy,
    start_picker,
    start_picker_fleet,
    start_valkey,
)
from tests.fake_pod import FakePod, running_pods
from tests.waiting import eventually

INTERVAL = 0.05


@pytest.fixture
async def pods() -> AsyncIterator[list[FakePod]]:
    async with running_pods(2) as started:
        yield started


class Replica:
    """One picker replica's scraper with its own Endpoint objects (replicas share no memory)."""

    def __init__(self, pods: list[FakePod], url: str, namespace: str, cadence: Cadence) -> None:
        self.endpoints = [p.endpoint for p in pods]
        self.pool = EndpointPool()
        self.pool.set_endpoints(self.endpoints)
        self.shared = SharedScrapes(url, namespace)
        self.scrapes = 0
        self.degraded: list[str] = []
        self.pool.subscribe(lambda event, e: self.degraded.append(e.address) if event is PoolEvent.DEGRADED else None)
        self.scraper = MetricsScraper(self.pool.all, cadence=cadence, shared=self.shared, health=self.pool,
                                      on_scrape=self._count)

    def _count(self, endpoint: Endpoint, ok: bool, unreadable: bool) -> None:
        self.scrapes += 1

    async def stop(self) -> None:
        await self.scraper.stop()
        await self.shared.close()


async def _replicas(n: int, pods: list[FakePod], url: str, cadence: Cadence) -> list[Replica]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    out = [Replica(pods, url, namespace, cadence) for _ in range(n)]
    for r in out:
        await r.scraper.start()
    return out


def test_record_round_trip() -> None:
    m = EndpointMetrics(waiting=2, running=3, kv_usage=0.5, block_size=64, num_gpu_blocks=160, prefix_queries=1000,
                        prefix_hits=500, prefill_tokens=7000, prefill_seconds=0.7, prefill_count=9, max_lora=2,
                        running_loras=frozenset({"a"}), waiting_loras=frozenset(), prompt_tokens=5200,
                        prompt_count=26)
    back = _decode(_encode(SharedSample("r1", 12.5, 0.1, m)))
    assert back.metrics == m and (back.replica, back.at, back.interval) == ("r1", 12.5, 0.1)
    older = msgpack.packb(["r0", 1.0, 0.1, [1, 0, 0.1, 16, 8, 0, 0, 0, [], []]])  # the previous release's record
    old = _decode(older).metrics
    assert old is not None and math.isnan(old.prompt_count) and math.isnan(old.prompt_tokens)
    assert replace(old, prompt_tokens=0.0, prompt_count=0.0) == EndpointMetrics(waiting=1, kv_usage=0.1,
                                                                               block_size=16, num_gpu_blocks=8)


def test_a_replica_reading_another_ones_record_after_its_own_scrape_sees_no_restart() -> None:
    """Its own scrape of the pod, then (the lease moved, or Redis came back) a later record of another replica's:
    every counter the restart check reads must travel in the record, or the pod looks restarted and its cache is
    forgotten by every replica."""
    own = EndpointMetrics(prefix_queries=1000, ttft_count=30, prompt_tokens=5200, prompt_count=26, updated_at=1.0)
    later = replace(own, prefix_queries=1100, ttft_count=31, prompt_tokens=5400, prompt_count=27)
    shared = _decode(_encode(SharedSample("r2", 2.0, 0.1, later))).metrics
    assert shared is not None
    assert started_over(own, replace(shared, updated_at=2.0)) == ""
    assert started_over(own, replace(shared, updated_at=2.0, prompt_count=0.0)) != ""  # a real restart still shows
    assert _decode(_encode(SharedSample("r1", 1.0, 0.1, None))).metrics is None
    assert SharedSample("r", 10.0, 1.0, None).fresh(11.4) and not SharedSample("r", 10.0, 1.0, None).fresh(11.6)


async def test_four_replicas_cost_each_pod_one_scrape_per_cadence(valkey: Valkey, pods: list[FakePod]) -> None:
    pods[0].waiting = 3
    replicas = await _replicas(4, pods, valkey.url, Cadence.fixed(INTERVAL))
    try:
        start = time.monotonic()
        # every replica sees pod 0's queue, whoever scraped it
        await eventually(lambda: all(r.endpoints[0].metrics.waiting == 3 for r in replicas), 5.0)
        await eventually(lambda: pods[0].hits >= 20, 10.0)
        elapsed = time.monotonic() - start
        # 20 scrapes at one per 50 ms take >= ~1 s; four replicas each scraping would take 0.25 s
        assert elapsed >= 20 * INTERVAL * 0.7, f"{pods[0].hits} scrapes in {elapsed:.2f}s"
        assert sum(r.scrapes for r in replicas) <= pods[0].hits + pods[1].hits
        now = time.monotonic()
        assert all(now - e.metrics.updated_at < 0.5 for r in replicas for e in r.endpoints)  # all current
        # the scraping replica goes away: another takes each pod over within a cadence and a grace
        busiest = max(replicas, key=lambda r: r.scrapes)
        await busiest.stop()
        replicas.remove(busiest)
        hits = pods[0].hits
        await eventually(lambda: pods[0].hits >= hits + 10, 5.0)
        pods[0].waiting = 7
        await eventually(lambda: all(r.endpoints[0].metrics.waiting == 7 for r in replicas), 5.0)
    finally:
        for r in replicas:
            await r.stop()


async def test_the_scraping_replica_renews_its_lease_without_reading_and_readers_read_once_a_cadence(
        valkey: Valkey, pods: list[FakePod]) -> None:
    """Every read and claim is a Redis round trip each replica pays for each pod at the pods' cadence: the replica
    that scrapes a pod does not read back the record it wrote, and the others read each record about once."""
    replicas = await _replicas(4, pods, valkey.url, Cadence.fixed(INTERVAL))
    try:
        await eventually(lambda: all(e.metrics.updated_at > 0 for r in replicas for e in r.endpoints), 5.0)
        before = [(r.shared.reads, r.shared.claims, r.scrapes) for r in replicas]
        hits = sum(p.hits for p in pods)
        start = time.monotonic()
        await eventually(lambda: sum(p.hits for p in pods) >= hits + 2 * 20, 10.0)
        cadences = (time.monotonic() - start) / INTERVAL * len(pods)  # each pod's cadences, summed over pods
        for replica, (reads, claims, scrapes) in zip(replicas, before, strict=True):
            own = replica.scrapes - scrapes  # the pods it scraped, a claim each
            read = replica.shared.reads - reads
            assert replica.shared.claims - claims <= own + 0.2 * cadences
            # the records of the pods it does not scrape, about once a cadence; none of its own
            assert read <= 1.3 * (cadences - own) + 0.1 * cadences, (read, own, cadences)
    finally:
        for r in replicas:
            await r.stop()


async def test_a_pod_with_failing_metrics_is_degraded_on_every_replica(valkey: Valkey, pods: list[FakePod]) -> None:
    replicas = await _replicas(3, pods, valkey.url, Cadence.fixed(INTERVAL))
    try:
        await eventually(lambda: all(r.endpoints[1].metrics.updated_at > 0 for r in replicas), 5.0)
        pods[1].mode = "error"
        await eventually(lambda: all(r.endpoints[1].state is EndpointState.DEGRADED for r in replicas), 5.0)
        assert all(r.degraded == [r.endpoints[1].address] for r in replicas)
        assert all(r.endpoints[0].state is EndpointState.READY for r in replicas)
    finally:
        for r in replicas:
            await r.stop()


async def test_without_redis_each_replica_scrapes_for_itself(pods: list[FakePod]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    replicas = await _replicas(2, pods, url, Cadence(fast=0.05, slow=0.2))
    try:
        pods[0].waiting = 2
        await eventually(lambda: all(r.endpoints[0].metrics.waiting == 2 for r in replicas), 5.0)
        await eventually(lambda: all(r.scrapes >= 4 for r in replicas), 5.0)
        assert all(r.shared.errors > 0 for r in replicas)
    finally:
        for r in replicas:
            await r.stop()


def _sampled(picker: Picker, name: str, **labels: str) -> float:
    """The sum of one replica's samples of series `name` whose labels include `labels`."""
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:
        return sum(s.value for family in text_string_to_metric_families(response.read().decode())
                   for s in family.samples if s.name == name and labels.items() <= s.labels.items())


def _scrapes(picker: Picker, pod: str) -> float:
    """picker_model_server_scrapes_total of one replica for one pod (ok and error)."""
    return _sampled(picker, "picker_model_server_scrapes_total", model_server_pod=pod)


async def _chat_through(envoy: Envoy, n: int) -> list[int]:
    async with aiohttp.ClientSession() as session:
        statuses = []
        for i in range(n):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"question {i} " * 30}]}
            async with session.post(f"{envoy.url}/v1/chat/completions", json=body) as response:
                statuses.append(response.status)
        return statuses


async def test_through_envoy_a_calm_pod_is_scraped_slowly_a_queueing_one_fast() -> None:
    with process_scope("cadence-envoy") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=["--metrics-slow-interval", "400ms",
                                                                            "--metrics-fast-interval", "20ms"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses)
        started.append(envoy.process)
        assert await _chat_through(envoy, 6) == [200] * 6
        calm, busy = backends.addresses
        set_echo_metrics(busy, waiting=3)  # the pod starts queueing: watched closely from its next scrape
        await eventually(lambda: _scrapes(picker, busy) >= 1, 5.0)
        start_busy, start_calm = _scrapes(picker, busy), _scrapes(picker, calm)
        await eventually(lambda: _scrapes(picker, busy) >= start_busy + 25, 10.0)
        assert _scrapes(picker, calm) <= start_calm + 3  # 25 fast scrapes take ~0.5 s: about one slow period


async def test_through_envoy_three_replicas_scrape_each_pod_as_often_as_one() -> None:
    with process_scope("shared-scrapes-envoy") as (logdir, started):
        valkey = start_valkey(logdir)
        started.append(valkey.process)
        backends = start_backends(2, logdir)
        started.append(backends.process)
        flags = ["--index-backend", "redis", "--redis-url", valkey.url, "--index-namespace", "scrapes",
                 "--metrics-slow-interval", "200ms"]
        fleet = start_picker_fleet(logdir, backends.addresses, flags=flags, replicas=3, name="replica", first_host=20)
        started += fleet.processes
        pickers = fleet.pickers
        assert await _chat_through(fleet.envoy, 9) == [200] * 9
        pod = backends.addresses[0]

        def total() -> float:
            return sum(_scrapes(p, pod) for p in pickers)

        before = total()
        start = time.monotonic()
        await eventually(lambda: total() >= before + 6, 10.0)
        elapsed = time.monotonic() - start
        # one scrape per 200 ms for the whole fleet: 6 take >= ~1.2 s; three replicas each scraping: ~0.4 s
        assert elapsed >= 6 * 0.2 * 0.7, f"6 scrapes of {pod} in {elapsed:.2f}s"
        # what it cost Redis, on each replica's /metrics: the others' records read, leases, our records published
        calls = {call: [_sampled(p, "picker_shared_scrape_calls_total", call=call) for p in pickers]
                 for call in ("read", "claim", "publish")}
        assert all(n > 0 for n in calls["read"]) and sum(calls["claim"]) > 0
        assert sum(calls["publish"]) >= 6 and [_sampled(p, "picker_shared_scrape_errors_total") for p in pickers] == [0] * 3

