"""Fuzzing what an outsider controls: request bodies of any JSON shape, and any sequence of ext_proc messages.

The contract is narrow: a body is either routed or refused with a RequestError (a 4xx the client gets), and a
stream is answered message by message or ended as a ProtocolViolation (INVALID_ARGUMENT). Nothing else may
escape: any other exception ends the stream with INTERNAL, and Envoy would fail open past admission.
The in-flight count of every pod must come back to zero when the stream ends, however it ended.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from picker.core.memory import AllocatorTrim
from picker.core.requests import RequestError, build_request
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.extproc.limits import BodyBudget
from picker.extproc.servicer import Phase, ProtocolViolation, _Stream
from picker.routing.director import Director
from picker.scheduling.config import build_scheduler

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any code point, lone surrogates included (json.dumps writes them as \ud800 escapes, as an attacker would).
TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12) | \
    st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00"])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)
MESSAGE = st.fixed_dictionaries({}, optional={"role": JSON, "content": JSON | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JSON}, optional={"text": JSON}),
    max_size=3)})
# Bodies near the shape of a real request (so the fuzzer reaches past the first check), and any JSON at all.
REQUEST = st.fixed_dictionaries({}, optional={
    "model": st.just("tiny") | JSON, "messages": st.lists(MESSAGE | JSON, max_size=3) | JSON,
    "prompt": TEXT | st.lists(TEXT | st.integers(), max_size=3) | JSON, "input": JSON, "instructions": JSON,
    "tools": JSON, "stream": JSON, "max_tokens": JSON, "cache_salt": TEXT | JSON})
PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                         "/v1/conversations", "/v1/models", "/v1/completions?stream=1", "/", "/x/completions/"])
METHODS = st.sampled_from(["POST"] * 8 + ["GET", "DELETE", "OPTIONS", "PUT", "post"])


def encoded(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


BODIES = REQUEST.map(encoded) | JSON.map(encoded) | st.binary(max_size=64) | st.builds(
    lambda depth: b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}", st.integers(0, 5000)) | st.builds(
    lambda digits: b'{"model": "tiny", "max_tokens": ' + b"9" * digits + b', "prompt": "x"}', st.integers(1, 9000))


@FUZZ
@given(body=BODIES, path=PATHS, method=METHODS,
       headers=st.just({}) | st.dictionaries(st.sampled_from([
           "x-slo-ttft-ms", "x-session-id", "x-gateway-inference-objective", "x-gateway-model-name-rewrite"]),
           TEXT | st.sampled_from(["250", "0.5", "-1", "nan"]), max_size=2))
def test_any_body_is_routed_or_refused_with_a_client_error(body: bytes, path: str, method: str,
                                                           headers: dict[str, str]) -> None:
    try:
        request = build_request({":path": path, ":method": method, **headers}, body, request_id="r")
    except RequestError as err:
        assert 400 <= err.status < 500 and err.code and err.message
        json.dumps({"error": {"code": err.code, "message": err.message}}).encode("utf-8")  # the body it becomes
        event(f"refused: {err.code}")
        return
    event("routed")
    # What routing hashes and labels with is always encodable text.
    request.model.encode("utf-8")
    request.prompt_text.encode("utf-8")
    if request.cache_salt is not None:
        request.cache_salt.encode("utf-8")


def headers(path: str, method: str, eos: bool, length: str | None) -> pb.HttpHeaders:
    values = {":path": path, ":method": method, "content-type": "application/json"}
    if length is not None:
        values["content-length"] = length
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]), end_of_stream=eos)


GOOD = encoded({"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]})
MODES = st.sampled_from([pm.ProcessingMode.NONE, pm.ProcessingMode.BUFFERED, pm.ProcessingMode.STREAMED,
                         pm.ProcessingMode.FULL_DUPLEX_STREAMED, pm.ProcessingMode.BUFFERED_PARTIAL])
CHUNKS = st.sampled_from([GOOD, GOOD[:10], GOOD[10:], b"", b"\xff\xfe", b"{}"]) | BODIES


def _message(kind: str, draw: Any) -> pb.ProcessingRequest:
    eos = draw(st.booleans())
    if kind == "request_headers":
        message = pb.ProcessingRequest(request_headers=headers(
            draw(PATHS), draw(METHODS), eos, draw(st.none() | st.sampled_from(["0", "12", "99999999999", "x"]))))
    elif kind == "request_body":
        message = pb.ProcessingRequest(request_body=pb.HttpBody(body=draw(CHUNKS), end_of_stream=eos))
    elif kind == "response_headers":
        message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=eos))
    elif kind == "response_body":
        message = pb.ProcessingRequest(response_body=pb.HttpBody(
            body=draw(st.sampled_from([b'data: {"usage": {"prompt_tokens": 3}}\n\n', b"{}", b"\xff"])),
            end_of_stream=eos))
    elif kind == "request_trailers":
        message = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    elif kind == "response_trailers":
        message = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    else:
        message = pb.ProcessingRequest()
    if draw(st.booleans()):
        message.protocol_config.request_body_mode = draw(MODES)
        message.protocol_config.response_body_mode = draw(MODES)
    return message


KINDS = st.sampled_from(["request_headers", "request_body", "request_trailers", "response_headers",
                         "response_body", "response_trailers", "empty"])


@st.composite
def sequences(draw: Any) -> list[pb.ProcessingRequest]:
    """Mostly in protocol order (so routing is reached), sometimes anything at all."""
    if draw(st.booleans()):
        kinds = ["request_headers", *draw(st.lists(st.sampled_from(["request_body"]), max_size=3)),
                 *draw(st.lists(KINDS, max_size=4))]
    else:
        kinds = draw(st.lists(KINDS, min_size=1, max_size=8))
    return [_message(kind, draw) for kind in kinds]


def fleet() -> tuple[Director, list[Endpoint]]:
    endpoints = [Endpoint.from_address(f"10.0.0.{i}:8000") for i in (1, 2)]
    for endpoint in endpoints:
        endpoint.metrics = EndpointMetrics(updated_at=0.0)
    pool = EndpointPool()
    pool.set_endpoints(endpoints)
    return Director(pool, build_scheduler(rng=random.Random(0)), clock=lambda: 0.0), endpoints


@FUZZ
@given(messages=sequences())
async def test_any_message_sequence_is_answered_or_a_protocol_violation(messages: list[pb.ProcessingRequest]) -> None:
    director, endpoints = fleet()
    budget = BodyBudget(8192)
    stream = _Stream(director, 4096, budget, AllocatorTrim(None))
    try:
        for message in messages:
            try:
                responses = await stream.handle(message)
            except ProtocolViolation:
                break
            assert all(isinstance(r, pb.ProcessingResponse) for r in responses)
            for response in responses:
                if response.HasField("immediate_response"):
                    assert 400 <= response.immediate_response.status.code < 600
            if stream.phase is Phase.DONE:
                break
    finally:
        event(f"ended in phase {stream.phase.value}")  # --hypothesis-show-statistics: how far the fuzzer got
        stream.release()  # what Process does however the stream ended
    assert [e.in_flight for e in endpoints] == [0, 0]
    assert [e.in_flight_tokens for e in endpoints] == [0, 0]
    assert budget.held == 0


@pytest.mark.parametrize("digits", [4301, 100_000])
def test_huge_integers_are_invalid_json(digits: int) -> None:
    with pytest.raises(RequestError) as err:
        build_request({":path": "/v1/completions"}, b'{"model": "m", "prompt": ' + b"9" * digits + b"}",
                      request_id="r")
    assert err.value.status == 400 and err.value.code == "invalid_json" and "digits" in err.value.message
