"""Replicas sharing their in-flight counts through a real valkey-server, falling back to their own when it is gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgpack
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from picker.core.replicas import ReplicaView
from picker.endpoints.shared_load import SharedLoad, decode, encode
from picker.endpoints.state import Endpoint
from picker_lab.supervisor import (
    Managed,
    Picker,
    PickerFleet,
    Valkey,
    process_scope,
    start_backends,
    start_picker_fleet,
    start_valkey,
)
from tests.waiting import eventually, eventually_async

PODS = ("10.0.0.1:8000", "10.0.0.2:8000")


class Clock:
    """Wall time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _gone(client: aioredis.Redis, key: str, field: str) -> bool:
    return not await client.hexists(key, field)


def _replica(url: str, namespace: str, clock: Clock, name: str) -> tuple[SharedLoad, list[Endpoint]]:
    pods = [Endpoint.from_address(a) for a in PODS]
    return SharedLoad(url, namespace, lambda: pods, interval=0.05, stale=1.0, replica_id=name, wall_clock=clock), pods


def test_report_round_trip_lists_only_pods_with_requests() -> None:
    busy, idle = (Endpoint.from_address(a) for a in PODS)
    busy.start_request(300, 0.0)
    busy.start_request(200, 0.0)
    assert decode(encode(12.5, 0.05, [busy, idle])) == (12.5, 0.05, [(PODS[0], 2, 500)], None)
    assert decode(encode(12.5, 0.05, [idle], 2.7)) == (12.5, 0.05, [], 2.7)  # what the replica learned
    assert decode(msgpack.packb([12.5, 0.05, []])) == (12.5, 0.05, [], None)  # an earlier release's report
    for bad in (["late", 0.05, [["x", "y"]]], [12.5, 0.05, [], 0.0], [12.5, 0.05, [], "many"]):
        with pytest.raises(ValueError, match="malformed"):
            decode(msgpack.packb(bad))


async def test_each_replica_counts_the_others_requests(valkey: Valkey) -> None:
    clock, changes = Clock(), list[int]()
    namespace = uuid.uuid4().hex
    a, pods_a = _replica(valkey.url, namespace, clock, "a")
    b, pods_b = _replica(valkey.url, namespace, clock, "b")
    b.on_change = changes.append
    try:
        pods_a[0].start_request(400, 0.0)
        pods_a[0].start_request(100, 0.0)
        pods_b[1].start_request(50, 0.0)
        assert await a.sync_once() and await b.sync_once() and await a.sync_once()
        assert [(e.fleet_in_flight, e.peer_in_flight_tokens, e.in_flight) for e in pods_b] == [(2, 500, 0), (1, 0, 1)]
        assert [(e.fleet_in_flight, e.peer_in_flight_tokens, e.in_flight) for e in pods_a] == [(2, 0, 2), (1, 50, 0)]
        assert b.stats.peers == 1 and changes[-1] == 1
        # each knows its place among the replicas reporting (ordered by id: both agree)
        a.position, b.position = ReplicaView(), ReplicaView()
        assert await a.sync_once() and await b.sync_once()
        assert (a.position.index, a.position.count, b.position.index, b.position.count) == (0, 2, 1, 2)
        # what one has learned of the traffic the other hears (a replica just started routes on it)
        assert b.position.peers_chars_per_token is None
        a.position.chars_per_token = 2.7
        assert await a.sync_once() and await b.sync_once()
        assert b.position.peers_chars_per_token == 2.7 and a.position.peers_chars_per_token is None
        pods_a[0].finish_request(400)
        pods_b[1].start_request(70, 0.0)  # counted at once by its own replica, by the other at the next sync
        assert pods_b[1].fleet_in_flight == 2 and pods_a[1].fleet_in_flight == 1
        assert await a.sync_once() and await b.sync_once()
        assert [e.fleet_in_flight for e in pods_b] == [1, 2]
        await a.close()  # a stopping replica takes its report with it
        assert await b.sync_once()
        assert [e.fleet_in_flight for e in pods_b] == [0, 2] and b.stats.peers == 0
        assert (b.position.index, b.position.count) == (0, 1)  # alone again
    finally:
        await b.close()


async def test_a_peers_pick_counts_at_once_until_its_report_replaces_it(valkey: Valkey) -> None:
    clock = Clock()
    namespace = uuid.uuid4().hex
    a, pods_a = _replica(valkey.url, namespace, clock, "a")
    b, pods_b = _replica(valkey.url, namespace, clock, "b")
    b.find = {e.address: e for e in pods_b}.get
    try:
        pods_a[1].start_request(400, 0.0)  # a routes a request; b hears of the pick through the shared index
        b.peer_picked(PODS[1], 400)  # its prompt in tokens (1,600 characters at 4 a token)
        b.peer_picked("10.9.9.9:8000", 100)  # a pod b does not know: ignored
        assert (pods_b[1].fleet_in_flight, pods_b[1].peer_in_flight_tokens, pods_b[1].in_flight) == (1, 400, 0)
        pods_a[1].finish_request(400)  # it ended before a's next report: the report says so
        assert await a.sync_once() and await b.sync_once()
        assert (pods_b[1].fleet_in_flight, pods_b[1].peer_in_flight_tokens) == (0, 0)
    finally:
        for replica in (a, b):
            await replica.close()


async def test_a_silent_replica_stops_counting_and_an_abandoned_report_is_deleted(valkey: Valkey) -> None:
    clock = Clock()
    namespace = uuid.uuid4().hex
    a, pods_a = _replica(valkey.url, namespace, clock, "a")
    b, pods_b = _replica(valkey.url, namespace, clock, "b")
    client = aioredis.Redis.from_url(valkey.url)
    try:
        pods_a[0].start_request(10, 0.0)
        assert await a.sync_once() and await b.sync_once()
        assert pods_b[0].fleet_in_flight == 1
        clock.now += 1.5  # a is hung: its report is older than `stale`
        assert await b.sync_once()
        assert pods_b[0].fleet_in_flight == 0
        assert await client.hexists(b.key, "a")
        clock.now += 60
        assert await b.sync_once()
        await eventually_async(lambda: _gone(client, b.key, "a"), "the abandoned report deleted", 2.0)
    finally:
        await client.aclose()
        for replica in (a, b):
            await replica.close()


async def test_without_redis_each_replica_falls_back_to_its_own_counts_and_recovers() -> None:
    with process_scope("shared-load-outage") as (logdir, started):
        valkey = start_valkey(logdir)
        started.append(valkey.process)
        clock = Clock()
        a, pods_a = _replica(valkey.url, "outage", clock, "a")
        b, pods_b = _replica(valkey.url, "outage", clock, "b")
        try:
            pods_a[0].start_request(10, 0.0)
            pods_b[0].start_request(10, 0.0)
            assert await a.sync_once() and await b.sync_once()
            assert pods_b[0].fleet_in_flight == 2
            valkey.process.stop()
            clock.now += 0.5  # within `stale`: the peers' last counts still hold
            assert not await b.sync_once()
            assert pods_b[0].fleet_in_flight == 2 and not b.stats.connected
            clock.now += 1.0  # past it: our own requests alone, as without sharing
            assert not await b.sync_once()
            assert pods_b[0].fleet_in_flight == 1 and b.stats.peers == 0
            pods_b[0].start_request(10, 0.0)  # admission goes on counting its own
            assert pods_b[0].fleet_in_flight == 2
            restarted = start_valkey(logdir, port=valkey.port, name="valkey-again")
            started.append(restarted.process)
            ok = False
            for _ in range(100):  # the client reconnects on its next call
                ok = await a.sync_once()
                if ok:
                    break
                await asyncio.sleep(0.02)
            assert ok and await b.sync_once()
            assert pods_b[0].fleet_in_flight == 3 and b.stats.connected
        finally:
            for replica in (a, b):
                await replica.close()


def _series(picker: Picker, name: str) -> float:
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:
        return sum(s.value for family in text_string_to_metric_families(response.read().decode())
                   for s in family.samples if s.name == name)


@contextlib.contextmanager
def _two_replicas(scope: str, first_host: int) -> Iterator[tuple[Path, list[Managed], Valkey, PickerFleet]]:
    """A Valkey, two echo pods and two replicas behind one Envoy sharing their load every 20 ms; all stopped on
    exit."""
    with process_scope(scope) as (logdir, started):
        valkey = start_valkey(logdir)
        started.append(valkey.process)
        backends = start_backends(2, logdir)
        started.append(backends.process)
        flags = ["--index-backend", "redis", "--redis-url", valkey.url, "--index-namespace", scope,
                 "--shared-load-interval", "20ms"]
        fleet = start_picker_fleet(logdir, backends.addresses, flags=flags, replicas=2, name="replica",
                                   first_host=first_host)
        started += fleet.processes
        yield logdir, started, valkey, fleet


async def _stream(session: aiohttp.ClientSession, fleet: PickerFleet, i: int, events: int) -> int:
    """A streamed chat through the fleet's Envoy that stays open `events` x 0.1 s; its status."""
    body = {"model": "tiny", "stream": True, "test_events": events, "test_event_delay": 0.1,
            "messages": [{"role": "user", "content": f"question {i} " * 20}]}
    async with session.post(f"{fleet.envoy.url}/v1/chat/completions", data=json.dumps(body),
                            headers={"content-type": "application/json"}) as response:
        await response.read()
        return response.status


def _counts(fleet: PickerFleet, series: str) -> list[float]:
    return [_series(p, series) for p in fleet.pickers]


async def test_through_envoy_every_replica_sees_the_whole_fleets_requests_in_flight() -> None:
    with _two_replicas("shared-load-envoy", first_host=30) as (_, _, _, fleet):
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(_stream(session, fleet, i, 40)) for i in range(6)]
            try:
                # Envoy deals the six streams over both replicas; each admits on all six
                await eventually(lambda: _counts(fleet, "picker_endpoint_fleet_in_flight_requests") == [6, 6], 5.0,
                                 "every replica counting all six")
                own = _counts(fleet, "picker_endpoint_in_flight_requests")
                assert sum(own) == 6 and all(0 < n < 6 for n in own), own
                assert _counts(fleet, "picker_shared_load_peers") == [1, 1]
            finally:
                statuses = await asyncio.gather(*streams)
        assert statuses == [200] * 6
        await eventually(lambda: _counts(fleet, "picker_endpoint_fleet_in_flight_requests") == [0, 0], 5.0,
                         "the finished streams leaving every replica's count")


async def test_through_envoy_a_valkey_outage_fails_no_request_and_the_counts_come_back() -> None:
    """Valkey stops while streams run: every request still succeeds, each replica soon counts only its own, and
    once Valkey is back (empty, on the same port) every replica counts the whole fleet's again."""
    with _two_replicas("shared-load-outage-envoy", first_host=40) as (logdir, started, valkey, fleet):
        def fleet_counts() -> list[float]:
            return _counts(fleet, "picker_endpoint_fleet_in_flight_requests")

        def own_counts() -> list[float]:
            return _counts(fleet, "picker_endpoint_in_flight_requests")

        async with aiohttp.ClientSession() as session:
            first = [asyncio.create_task(_stream(session, fleet, i, 100)) for i in range(4)]
            await eventually(lambda: fleet_counts() == [4, 4], 5.0, "both replicas counting all four")
            valkey.process.stop()
            # Both conditions awaited together: a replica whose peer holds none of the streams counts only its own
            # at once, before it has noticed that Valkey is gone and dropped its peer.
            await eventually(lambda: fleet_counts() == own_counts() and sum(own_counts()) == 4
                             and _counts(fleet, "picker_shared_load_peers") == [0, 0], 5.0,
                             "each replica back to its own counts, with no peer")
            during = await asyncio.gather(*(_stream(session, fleet, 10 + i, 1) for i in range(4)))  # no Valkey
            restarted = start_valkey(logdir, port=valkey.port, name="valkey-again")
            started.append(restarted.process)
            await eventually(lambda: fleet_counts() == [4, 4], 10.0, "both replicas counting all four again")
            statuses = await asyncio.gather(*first)
        assert during == [200] * 4 and statuses == [200] * 4
