"""Requests through a real Envoy land where the picker said, in both body modes, for every body size."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import aiohttp
import grpc
import pytest

import picker.api  # noqa: F401
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker_lab.supervisor import Envoy
from tests.conftest import Stack

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(text: str = "hello", **extra: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}


async def post(envoy: Envoy, path: str, payload: object, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, object]]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with aiohttp.ClientSession() as session, session.post(envoy.url + path, data=data,
                                                                  headers=headers or {}) as response:
        return response.status, json.loads(await response.read())


@pytest.mark.parametrize("path,payload", [
    (CHAT, chat_body()),
    (COMPLETIONS, {"model": "tiny", "prompt": "Once upon a time"}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}),
])
async def test_request_lands_on_the_picked_endpoint(envoy: Envoy, stack: Stack, path: str,
                                                    payload: dict[str, object]) -> None:
    served = set()
    for i in range(9):
        # A distinct cold prompt each time: the picker spreads prompts no pod has cached.
        unique = json.loads(json.dumps(payload).replace("hello", f"hello {i} {envoy.port}")
                            .replace("Once upon", f"{i} {envoy.port} Once upon"))
        status, body = await post(envoy, path, unique)
        assert status == 200, body
        assert body["served_by"] in stack.backends.addresses
        # The pod that answered is exactly the one named in the picker's header.
        assert body["destination_header"] == body["served_by"]
        assert body["request_id"]
        served.add(body["served_by"])
    assert len(served) >= 2, "cold prompts should spread over idle pods"


async def test_sse_events_arrive_unbuffered(envoy: Envoy, stack: Stack) -> None:
    payload = chat_body(stream=True, test_events=3, test_event_delay=0.4)
    start = time.monotonic()
    arrivals = []
    async with aiohttp.ClientSession() as session, session.post(envoy.url + CHAT, json=payload) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "event" not in event:
                    continue  # the final usage chunk
                assert event["served_by"] == event["destination_header"]
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 3
    # The first event must not wait for the whole stream (0.8 s of later events).
    assert arrivals[0] < 0.6 and arrivals[-1] - arrivals[0] > 0.6, arrivals


@pytest.mark.parametrize("size", [1024, 256 * 1024, 8 * 2**20])
async def test_bodies_arrive_intact(envoy: Envoy, size: int) -> None:
    filler = "x" * (size - len(json.dumps(chat_body(""))))
    raw = json.dumps(chat_body(filler)).encode()
    assert abs(len(raw) - size) < 64
    status, body = await post(envoy, CHAT, raw)
    assert status == 200, body
    assert body["body_bytes"] == len(raw)
    assert body["body_sha256"] == hashlib.sha256(raw).hexdigest()


async def test_trickled_body(envoy: Envoy) -> None:
    raw = json.dumps(chat_body("slow " * 4000)).encode()

    async def trickle():  # type: ignore[no-untyped-def]
        for i in range(0, len(raw), 2048):
            yield raw[i:i + 2048]
            await asyncio.sleep(0.01)

    async with aiohttp.ClientSession() as session, session.post(envoy.url + CHAT, data=trickle()) as response:
        body = json.loads(await response.read())
        assert response.status == 200, body
    assert body["body_sha256"] == hashlib.sha256(raw).hexdigest()


async def test_header_only_request_goes_to_a_pool_endpoint(envoy: Envoy, stack: Stack) -> None:
    async with aiohttp.ClientSession() as session, session.get(envoy.url + "/version") as response:
        assert response.status == 200
        body = await response.json()
    assert body["served_by"] in stack.backends.addresses


async def test_models_are_listed_by_the_picker_for_the_whole_pool(envoy: Envoy, stack: Stack) -> None:
    async with aiohttp.ClientSession() as session, session.get(envoy.url + "/v1/models") as response:
        assert response.status == 200 and "x-picker-fail-open" not in response.headers
        body = await response.json()
    assert body["object"] == "list" and "served_by" not in body  # answered by the picker, not a pod
    assert {m["id"] for m in body["data"]} == {"tiny", "metrics-model", "usage-model", "gauge-model",
                                              "tiles-model"}


async def test_client_cannot_choose_its_endpoint(envoy: Envoy, stack: Stack) -> None:
    rogue = stack.rogue.addresses[0]
    for _ in range(4):
        status, body = await post(envoy, CHAT, chat_body(), {"x-gateway-destination-endpoint": rogue})
        assert status == 200
        assert body["served_by"] in stack.backends.addresses
    async with aiohttp.ClientSession() as session, session.get(f"http://{rogue}/test/count") as response:
        assert (await response.json())["requests"] == 0


async def in_flight(stack: Stack) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.picker.grpc_port}") as channel:
        listing = await picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest())
    return {e.address: e.in_flight for e in listing.endpoints}


async def test_a_buffered_request_costs_two_ext_proc_messages(envoy: Envoy, stack: Stack) -> None:
    # The picker turns the response headers off (no P/D, no response bodies shown); full duplex cannot.
    sent = envoy.ext_proc_messages_sent()
    for i in range(4):
        status, body = await post(envoy, CHAT, chat_body(f"two messages {i} {envoy.port}"))
        assert status == 200, body
    per_request = (envoy.ext_proc_messages_sent() - sent) / 4
    if envoy.settings.mode == "buffered":
        assert per_request == 2
    else:  # the response headers, body and trailers too
        assert per_request > 3


async def test_in_flight_counts_follow_the_stream_lifecycle(envoy: Envoy, stack: Stack) -> None:
    # A streamed response keeps its pod busy until the last event; then the count returns to zero.
    payload = chat_body(f"in flight {envoy.port}", stream=True, test_events=3, test_event_delay=0.3)
    async with aiohttp.ClientSession() as session, session.post(envoy.url + CHAT, json=payload) as response:
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        served = json.loads(first[6:])["served_by"]
        assert (await in_flight(stack))[served] == 1
        await response.read()
    for _ in range(50):
        if not any((await in_flight(stack)).values()):
            break
        await asyncio.sleep(0.05)
    assert not any((await in_flight(stack)).values()), await in_flight(stack)


async def test_an_anthropic_conversation_stays_on_the_pod_that_holds_its_prefix(envoy: Envoy, stack: Stack) -> None:
    system = f"You answer questions about port {envoy.port}. " * 60  # a long shared system prompt
    turns: list[dict[str, object]] = []
    served = set()
    for i in range(4):
        turns.append({"role": "user", "content": [{"type": "text", "text": f"question {i}"}]})
        status, body = await post(envoy, "/v1/messages", {"model": "tiny", "max_tokens": 8, "system": system,
                                                           "messages": turns})
        assert status == 200, body
        served.add(body["served_by"])
        turns.append({"role": "assistant", "content": f"answer {i}"})
    assert len(served) == 1  # every later turn extends the first one's prefix
