"""A raw ext_proc client against a running picker: the protocol in both body modes, subset hints, and
malformed streams that must produce errors rather than a crashed server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from tests.conftest import Stack

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]}).encode()


def headers_msg(path: str = "/v1/chat/completions", eos: bool = False, mode: int = pm.ProcessingMode.BUFFERED,
                subset: Sequence[str] | None = None, extra: dict[str, str] | None = None,
                response_mode: int | None = None) -> pb.ProcessingRequest:
    values = {":path": path, ":method": "POST", "content-type": "application/json", **(extra or {})}
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                                for k, v in values.items()]),
            end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode,  # type: ignore[arg-type]
                                                 response_body_mode=mode if response_mode is None  # type: ignore[arg-type]
                                                 else response_mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(list(subset))
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def body_msg(data: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


async def exchange(port: int, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            for m in messages:
                yield m

        return [r async for r in stub.Process(requests(), timeout=5)]


def destination(response: pb.ProcessingResponse, kind: str) -> str:
    common = getattr(response, kind).response
    assert common.clear_route_cache
    options = {o.header.key: o for o in common.header_mutation.set_headers}
    option = options["x-gateway-destination-endpoint"]
    assert not option.header.value  # raw_value only: Envoy ignores `value` and would send an empty header
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    meta = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert meta.string_value == option.header.raw_value.decode()
    return meta.string_value


def set_header_names(response: pb.ProcessingResponse, kind: str) -> set[str]:
    return {o.header.key for o in getattr(response, kind).response.header_mutation.set_headers}


async def test_buffered_conversation(stack: Stack) -> None:
    responses = await exchange(stack.picker.grpc_port, [headers_msg(extra={"x-request-id": "r1"}), body_msg(BODY)])
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    assert destination(responses[1], "request_body") in stack.backends.addresses
    assert set_header_names(responses[1], "request_body") == {"x-gateway-destination-endpoint"}


async def test_buffered_headers_turn_the_response_headers_off_when_nothing_reads_them(stack: Stack) -> None:
    none = pm.ProcessingMode.NONE
    responses = await exchange(stack.picker.grpc_port, [headers_msg(response_mode=none), body_msg(BODY)])
    override = responses[0].mode_override
    assert responses[0].HasField("mode_override")
    assert override.response_header_mode == pm.ProcessingMode.SKIP
    # Envoy takes the body modes from an override whatever they are: they restate the configured ones
    assert (override.request_body_mode, override.response_body_mode) == (pm.ProcessingMode.BUFFERED, none)
    assert override.request_trailer_mode == override.response_trailer_mode == pm.ProcessingMode.DEFAULT
    assert destination(responses[1], "request_body") in stack.backends.addresses
    # response bodies shown to the picker (token usage) need their headers; unknown modes are not overridden
    shown = await exchange(stack.picker.grpc_port, [headers_msg(response_mode=pm.ProcessingMode.STREAMED)])
    untold = headers_msg(response_mode=none)
    untold.ClearField("protocol_config")
    for responses in (shown, await exchange(stack.picker.grpc_port, [untold])):
        assert not responses[0].HasField("mode_override")


async def test_full_duplex_holds_headers_and_echoes_body_in_chunks(stack: Stack) -> None:
    big = json.dumps({"model": "tiny", "prompt": "z" * 150_000}).encode()
    chunks = [big[i:i + 40_000] for i in range(0, len(big), 40_000)]
    fd = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    messages = [headers_msg("/v1/completions", mode=fd)] + [body_msg(c, i == len(chunks) - 1)
                                                           for i, c in enumerate(chunks)]
    messages.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    messages.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n", end_of_stream=False)))
    messages.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)))
    responses = await exchange(stack.picker.grpc_port, messages)
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "request_headers"
    assert destination(responses[0], "request_headers") in stack.backends.addresses
    # No x-request-id from the client: the picker generates one.
    assert "x-request-id" in set_header_names(responses[0], "request_headers")
    echoed = [r.request_body.response.body_mutation.streamed_response for r in responses if
              r.WhichOneof("response") == "request_body"]
    assert b"".join(e.body for e in echoed) == big
    assert all(len(e.body) <= 62_000 for e in echoed)
    assert [e.end_of_stream for e in echoed] == [False] * (len(echoed) - 1) + [True]
    passed = [r.response_body.response.body_mutation.streamed_response for r in responses
              if r.WhichOneof("response") == "response_body"]
    assert [(p.body, p.end_of_stream) for p in passed] == [(b"data: 1\n\n", False), (b"data: [DONE]\n\n", True)]


async def test_request_trailers_are_answered(stack: Stack) -> None:
    fd = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    responses = await exchange(stack.picker.grpc_port, [
        headers_msg(mode=fd), body_msg(BODY, eos=False),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers())])
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"


async def test_subset_hint_limits_candidates(stack: Stack) -> None:
    target = stack.backends.addresses[1]
    for _ in range(5):
        responses = await exchange(stack.picker.grpc_port, [headers_msg(subset=[target]), body_msg(BODY)])
        assert destination(responses[1], "request_body") == target
    by_ip = await exchange(stack.picker.grpc_port, [headers_msg(subset=["127.0.0.1"]), body_msg(BODY)])
    assert destination(by_ip[1], "request_body") in stack.backends.addresses
    none = await exchange(stack.picker.grpc_port, [headers_msg(subset=["10.9.9.9:1"]), body_msg(BODY)])
    assert none[-1].immediate_response.status.code == 503


async def test_garbage_body_is_a_400_immediate_response(stack: Stack) -> None:
    responses = await exchange(stack.picker.grpc_port, [headers_msg(), body_msg(b"\xc3\x28garbage")])
    immediate = responses[-1].immediate_response
    assert immediate.status.code == 400
    assert json.loads(immediate.body)["error"]["code"] == "invalid_utf8"
    assert any(h.header.key == "content-type" and h.header.raw_value == b"application/json"
               for h in immediate.headers.set_headers)


@pytest.mark.parametrize("messages", [
    [body_msg(BODY)],  # body before headers
    [pb.ProcessingRequest()],  # no message at all (unknown or missing oneof)
    [headers_msg(), headers_msg()],  # headers twice
    [headers_msg(), body_msg(BODY), body_msg(BODY)],  # body after the decision
], ids=["body-first", "empty", "headers-twice", "body-after-decision"])
async def test_protocol_violations_are_errors(stack: Stack, messages: list[pb.ProcessingRequest]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await exchange(stack.picker.grpc_port, messages)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stack.check_alive()


async def test_undecodable_bytes_do_not_crash_the_server(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.picker.grpc_port}") as channel:
        call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)

        async def garbage() -> AsyncIterator[bytes]:
            yield b"\xff\xff\xff\xff\x0f not a protobuf"

        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in call(garbage(), timeout=5):
                pass
    stack.check_alive()
    responses = await exchange(stack.picker.grpc_port, [headers_msg(), body_msg(BODY)])
    assert destination(responses[1], "request_body") in stack.backends.addresses


async def metric_value(port: int, name: str, labels: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_corrupt_streams_are_counted_and_barely_logged(stack: Stack) -> None:
    # Anyone who reaches the port can send garbage: 50 streams must not write 50 tracebacks.
    port, name, labels = stack.picker.metrics_port, "picker_extproc_stream_errors_total", 'reason="malformed"'
    before, log_before = await metric_value(port, name, labels), len(stack.picker.process.log())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.picker.grpc_port}") as channel:
        call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)

        async def garbage() -> AsyncIterator[bytes]:
            yield b"\xff\xff\xff\xff\x0f not a protobuf"

        for _ in range(50):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call(garbage(), timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await metric_value(port, name, labels) == before + 50
    written = stack.picker.process.log()[log_before:]
    assert "Traceback" not in written
    assert written.count("\n") <= 10, written  # at most one window's burst (5), twice if a window turned
    stack.check_alive()
