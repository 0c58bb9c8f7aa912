"""Bounded memory and steering on the ext_proc port, with a picker of small limits behind real Envoy
(FULL_DUPLEX_STREAMED, where bodies reach the picker chunk by chunk as slow clients send them):

- unfinished bodies are refused beyond --max-buffered-bytes (503 buffers_full): what the picker holds stays under it;
- streams that go silent before their decision end after --stream-idle-timeout;
- streams routed and then held open (by a client talking to the port directly) stop counting in flight after
  --request-timeout, so the in-flight gauge returns to the true value.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker_lab.bench.uploads import MIB, picker_samples, unfinished_uploads
from picker_lab.supervisor import (
    Backends,
    Envoy,
    Picker,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
)
from tests.test_extproc_grpc import body_msg, headers_msg
from tests.waiting import eventually_async

CAP = 64 * MIB


@dataclass
class Limited:
    backends: Backends
    picker: Picker  # idle and request timeouts of seconds
    envoy: Envoy
    capped: Picker  # the body cap, and timeouts that never fire during a test: refusals are the cap's alone
    capped_envoy: Envoy


@pytest.fixture(scope="module")
def limited() -> Iterator[Limited]:
    with process_scope("limits") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=[
            "--max-buffered-bytes", "64Mi", "--stream-idle-timeout", "2s", "--request-timeout", "3s"])
        started.append(picker.process)
        capped = start_picker(logdir, endpoints=backends.addresses, name="capped",
                              extra=["--max-buffered-bytes", "64Mi", "--stream-idle-timeout", "300s"])
        started.append(capped.process)
        envoy = start_envoy(logdir, picker, backends.addresses, mode="full-duplex")
        started.append(envoy.process)
        capped_envoy = start_envoy(logdir, capped, backends.addresses, mode="full-duplex", name="envoy-capped")
        started.append(capped_envoy.process)
        yield Limited(backends, picker, envoy, capped, capped_envoy)


@pytest.mark.timeout(300)  # ~5 s on an idle 2-core machine; 600 MB through Envoy takes far longer on a busy one
async def test_unfinished_bodies_are_refused_past_the_total_cap(limited: Limited) -> None:
    """40 uploads of 15 MiB that never finish: the 4 the 64 MiB cap holds wait, the other 36 get 503 buffers_full
    (none fails otherwise: Envoy once reset every stream on its picker connection when the picker's flow-control
    windows let it queue too much), and the picker's RSS grows by what it holds plus a fixed ~40 MiB
    (`bench/upload_memory.py`; before windows were bounded and freed memory trimmed: +150 to +365 MiB)."""
    capped = limited.capped
    run = await unfinished_uploads(limited.capped_envoy.url, f"http://127.0.0.1:{capped.metrics_port}/metrics",
                                   capped.process, count=40, body_bytes=15 * MIB, cap=CAP, within=240)
    print(run.summary())
    assert run.complete, run.summary()  # all 36 refused, alone in ~5 s; far slower on a busy machine
    assert 0 < run.held_max <= CAP, run.summary()  # what the picker itself holds never passes the cap
    assert run.statuses == [503] * len(run.statuses), run.statuses
    assert run.rss_peak - run.rss_before <= CAP * 5 // 2, run.summary()  # a busy machine measured +127 MiB
    assert capped.process.alive()
    async with aiohttp.ClientSession() as session, session.post(limited.capped_envoy.url + "/v1/completions",
                                                                json={"model": "tiny", "prompt": "still serving"}) \
            as response:
        assert response.status == 200


async def test_silent_and_held_streams_end_and_stop_steering(limited: Limited) -> None:
    picker = limited.picker
    base = await picker_samples(f"http://127.0.0.1:{picker.metrics_port}/metrics")

    def in_flight(values: dict[tuple[str, str], float]) -> float:
        return values.get(("picker_endpoint_in_flight_requests", ""), 0.0)

    async with grpc.aio.insecure_channel(picker.target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        release = asyncio.Event()
        full = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        body = json.dumps({"model": "tiny", "prompt": "steer away"}).encode()

        async def held(route: bool) -> grpc.StatusCode:
            async def messages() -> AsyncIterator[pb.ProcessingRequest]:
                yield headers_msg("/v1/completions", mode=full)
                if route:
                    yield body_msg(body)
                await release.wait()

            try:
                async for _ in stub.Process(messages(), timeout=30):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        silent = [asyncio.create_task(held(False)) for _ in range(50)]
        routed = [asyncio.create_task(held(True)) for _ in range(50)]

        async def steered() -> bool:
            return in_flight(await picker_samples(f"http://127.0.0.1:{picker.metrics_port}/metrics")) >= in_flight(base) + 50

        await eventually_async(steered, "50 held requests count in flight", within=10)
        codes = await asyncio.wait_for(asyncio.gather(*silent, *routed), 20)
        release.set()
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    after = await picker_samples(f"http://127.0.0.1:{picker.metrics_port}/metrics")
    assert after[("picker_extproc_stream_errors_total", "timeout")] - \
        base.get(("picker_extproc_stream_errors_total", "timeout"), 0.0) == 100

    async def back_to_true_value() -> bool:
        return in_flight(await picker_samples(f"http://127.0.0.1:{picker.metrics_port}/metrics")) == in_flight(base)

    await eventually_async(back_to_true_value, "the in-flight gauge is back to its value before", within=5)
