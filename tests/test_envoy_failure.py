"""Picker outages through a real Envoy: fail-open keeps serving from the pool, fail-closed answers 5xx fast,
and a spoofed destination header never reaches a server outside the pool."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.supervisor import (
    Backends,
    Envoy,
    Picker,
    free_port,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
    start_picker_fleet,
)
from tests.waiting import eventually

CHAT = "/v1/chat/completions"
PAYLOAD = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}).encode()


@dataclass
class OutageStack:
    backends: Backends
    rogue: Backends
    picker: Picker
    open_buffered: Envoy
    open_full_duplex: Envoy
    closed: Envoy


@pytest.fixture(scope="module")
def outage() -> Iterator[OutageStack]:
    with process_scope("outage") as (logdir, started):
        backends = start_backends(2, logdir)
        rogue = start_backends(1, logdir, name="rogue")
        started += [backends.process, rogue.process]
        picker = start_picker(logdir, endpoints=backends.addresses)
        started.append(picker.process)
        envoys = [
            start_envoy(logdir, picker, backends.addresses, mode="buffered", fail_open=True, name="open-buffered"),
            start_envoy(logdir, picker, backends.addresses, mode="full-duplex", fail_open=True, name="open-fd"),
            start_envoy(logdir, picker, backends.addresses, mode="buffered", fail_open=False, name="closed"),
        ]
        started += [e.process for e in envoys]
        yield OutageStack(backends, rogue, picker, *envoys)


async def load(envoy: Envoy, stop: asyncio.Event, results: list[tuple[float, int, str]],
               headers: dict[str, str] | None = None) -> None:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            started = time.monotonic()  # results are keyed by start time: compare with the kill instant
            try:
                async with session.post(envoy.url + CHAT, data=PAYLOAD, headers=headers or {}) as response:
                    text = await response.text()
                    served = json.loads(text).get("served_by", "") if response.status == 200 else text
                    results.append((started, response.status, served))
            except aiohttp.ClientError as exc:
                results.append((started, -1, repr(exc)))


async def test_picker_killed_under_load(outage: OutageStack) -> None:
    stop = asyncio.Event()
    results: dict[str, list[tuple[float, int, str]]] = {"open-buffered": [], "open-fd": [], "closed": []}
    envoys = {"open-buffered": outage.open_buffered, "open-fd": outage.open_full_duplex, "closed": outage.closed}
    tasks = [asyncio.create_task(load(envoys[name], stop, results[name])) for name in envoys for _ in range(3)]
    await eventually(lambda: all(any(status == 200 for _, status, _ in rows) for rows in results.values()), 10.0,
                     "every Envoy served through the picker before the kill")
    killed_at = time.monotonic()
    outage.picker.process.kill()

    def after(name: str, delay: float = 0.0) -> int:
        return sum(1 for at, _, _ in results[name] if at > killed_at + delay)

    await eventually(lambda: after("open-buffered") > 20 and after("open-fd", 0.2) >= 3
                     and after("closed", 0.2) >= 3, 15.0, "requests answered by every Envoy after the kill")
    stop.set()
    await asyncio.gather(*tasks)

    bad = [r for r in results["open-buffered"] if r[1] != 200 or r[2] not in outage.backends.addresses]
    assert not bad, f"fail-open let requests fail: {bad[:3]}"
    # Envoy 1.40 does not fail open in FULL_DUPLEX_STREAMED mode (GIE issue #1266): it answers 500, promptly.
    # This is why our recommended config is BUFFERED; the assertion flags it if a later Envoy fixes this.
    fd_after = [r for r in results["open-fd"] if r[0] > killed_at + 0.2]
    assert fd_after and all(status == 500 for _, status, _ in fd_after), sorted({(s, w[:80]) for _, s, w in fd_after})
    closed_after = [r for r in results["closed"] if r[0] > killed_at + 0.2]
    assert closed_after, "fail-closed: requests hung after the kill"
    assert all(500 <= status < 600 for _, status, _ in closed_after), closed_after[:3]
    assert any(status == 200 for at, status, _ in results["closed"] if at < killed_at)

    # Picker still down: a spoofed header must not reach the rogue server, fail-open or not.
    rogue = outage.rogue.addresses[0]
    spoof: list[tuple[float, int, str]] = []
    stop = asyncio.Event()
    task = asyncio.create_task(load(outage.open_buffered, stop, spoof, {"x-gateway-destination-endpoint": rogue}))
    await eventually(lambda: len(spoof) >= 10, 10.0, "spoofed requests answered")
    stop.set()
    await task
    assert spoof and all(status == 200 and served in outage.backends.addresses for _, status, served in spoof)
    async with aiohttp.ClientSession() as session, session.get(f"http://{rogue}/test/count") as response:
        assert (await response.json())["requests"] == 0


def test_sigterm_stops_the_picker_gracefully() -> None:
    import signal

    with process_scope("sigterm") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses)
        started.append(picker.process)
        began = time.monotonic()
        picker.process.proc.send_signal(signal.SIGTERM)
        assert picker.process.proc.wait(10) == 0, picker.process.log()
        assert time.monotonic() - began < 8


async def test_a_frozen_replica_is_ejected_within_two_message_timeouts_while_the_other_serves() -> None:
    """A hung picker (SIGSTOP: its sockets still accept) stalls the streams sent to it by Envoy's message_timeout
    (5 s) each; the health check on its plaintext health port must take it out of rotation within two of those,
    and from then on the other replica routes everything at once."""
    with process_scope("frozen-replica") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, replicas=2, name="frozen", first_host=40)
        started += fleet.processes
        frozen, other = fleet.pickers
        envoy = fleet.envoy
        timeout = float(envoy.settings.message_timeout.rstrip("s"))
        frozen.process.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            await eventually(lambda: not replica_healthy(envoy, frozen), 2 * timeout, "the frozen replica ejected")
            ejected_after = time.monotonic() - stopped_at
            before = routed_by(other)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                for _ in range(10):
                    began = time.monotonic()
                    async with session.post(envoy.url + CHAT, data=PAYLOAD) as response:
                        assert response.status == 200
                    assert time.monotonic() - began < 1.0  # no stream waits on the frozen one any more
            assert routed_by(other) - before == 10  # routed by the picker, not failed open
            print(f"frozen replica ejected after {ejected_after:.1f} s (message timeout {timeout:g} s)")
        finally:
            frozen.process.proc.send_signal(signal.SIGCONT)
        await eventually(lambda: replica_healthy(envoy, frozen), 15, "the thawed replica back in rotation")


def replica_healthy(envoy: Envoy, picker: Picker) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin_port}/clusters", timeout=1) as response:
        lines = response.read().decode().splitlines()
    prefix = f"picker::{picker.host}:{picker.grpc_port}::health_flags::"
    return any(line == prefix + "healthy" for line in lines)


def routed_by(picker: Picker) -> float:
    """Requests this replica routed (inference_objective_request_total over every label)."""
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:
        return sum(s.value for f in text_string_to_metric_families(response.read().decode())
                   if f.name == "inference_objective_request" for s in f.samples if s.name.endswith("_total"))


def health_status(picker: Picker, service: str) -> int:
    with grpc.insecure_channel(f"{picker.host}:{picker.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


async def test_a_replica_with_an_empty_pool_is_not_ready_and_envoy_routes_through_the_other() -> None:
    """A replica whose pool is empty can only answer 503: its readiness (and the ext_proc health service Envoy
    checks) is NOT_SERVING while it stays alive, so Envoy sends every stream to the replica that has endpoints,
    and the empty one comes back once its pool has an endpoint again."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with process_scope("empty-pool") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        empty_file = logdir / "empty.yaml"
        empty_file.write_text("[]\n")
        grpc_port, health_port = free_port(), free_port()  # replicas behind one Envoy cluster share their ports
        empty = start_picker(logdir, endpoints_file=empty_file, name="empty", host="127.0.0.60",
                             grpc_port=grpc_port, health_port=health_port)
        started.append(empty.process)
        full = start_picker(logdir, endpoints=backends.addresses, name="full", host="127.0.0.61",
                            grpc_port=grpc_port, health_port=health_port)
        started.append(full.process)
        assert health_status(empty, "liveness") == serving
        for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert health_status(empty, service) == not_serving
            assert health_status(full, service) == serving
        envoy = start_envoy(logdir, [empty, full], backends.addresses, name="envoy-empty-pool", wait_for_picker=False)
        started.append(envoy.process)
        await eventually(lambda: replica_healthy(envoy, full), 15, "the replica with endpoints healthy")
        assert not replica_healthy(envoy, empty)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for _ in range(10):
                async with session.post(envoy.url + CHAT, data=PAYLOAD) as response:
                    assert response.status == 200
        assert routed_by(full) == 10 and routed_by(empty) == 0
        empty_file.write_text("".join(f"- {a}\n" for a in backends.addresses))
        await eventually(lambda: health_status(empty, "readiness") == serving, 10, "readiness once it has endpoints")
        await eventually(lambda: replica_healthy(envoy, empty), 15, "the replica back in Envoy's rotation")
        empty_file.write_text("[]\n")
        await eventually(lambda: health_status(empty, "readiness") == not_serving, 10, "not ready when emptied again")
        assert health_status(empty, "liveness") == serving
