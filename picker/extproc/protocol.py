"""Envoy ext_proc protocol constants and response builders (Envoy 1.40 behaviour).

Builders return fresh upb messages; the constant ones are shared because responses are never mutated
after they are built.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from picker.core import headers as names

DESTINATION_HEADER = names.DESTINATION
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"

# Envoy splits streamed body mutations; 62,000 bytes keeps each chunk under its per-message limit.
STREAMED_CHUNK_BYTES = 62_000

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
FULL_DUPLEX_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
BUFFERED_PARTIAL = processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL
NONE = processing_mode_pb2.ProcessingMode.NONE

EMPTY_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
EMPTY_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
EMPTY_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
EMPTY_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
EMPTY_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
EMPTY_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
# BUFFERED request headers answered with the response's headers turned off for this stream (Envoy honours it with
# `allow_mode_override`): one message fewer per request when nothing needs to hear the response begin. An override
# restates both body modes (Envoy copies them whatever they are; DEFAULT header and trailer modes are left as
# configured). Envoy still keeps the stream open until the response ends, which ends the in-flight count.
REQUEST_HEADERS_RESPONSE_UNSEEN = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=BUFFERED, response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
        response_body_mode=NONE))


def header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header to set. Envoy ext_proc reads `raw_value`; `value` would produce an empty header."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def routing_metadata(destination: str) -> struct_pb2.Struct:
    """`envoy.lb` dynamic metadata carrying the destination (wins over the header in ORIGINAL_DST)."""
    meta = struct_pb2.Struct()
    meta.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    return meta


def routing_common(destination: str, extra_headers: dict[str, str] | None = None,
                   removed: tuple[str, ...] = ()) -> pb.CommonResponse:
    """The mutation that routes a request: destination header (always overwriting), the other headers set or
    removed, and a route cache refresh. Nothing else is touched (docs/protocol.md lists what may be).

    `clear_route_cache` makes Envoy re-evaluate routes after the mutation, which is what lets a
    fallback route (no destination header → round-robin) coexist with the picker's route.
    """
    mutation = pb.HeaderMutation(set_headers=[header_option(DESTINATION_HEADER, destination)])
    if extra_headers:
        mutation.set_headers.extend(header_option(k, v) for k, v in extra_headers.items())
    if removed:
        mutation.remove_headers.extend(removed)
    return pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)


def route_by_headers(destination: str, extra_headers: dict[str, str] | None = None,
                     removed: tuple[str, ...] = ()) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=routing_common(destination, extra_headers, removed)),
        dynamic_metadata=routing_metadata(destination),
    )


def route_by_body(destination: str, extra_headers: dict[str, str] | None = None, removed: tuple[str, ...] = (),
                  body: bytes | None = None) -> pb.ProcessingResponse:
    """BUFFERED mode: the header mutation rides on the body response (headers were already answered); `body`
    replaces the request body (the caller sets its content-length: in this mode that is ours to keep right)."""
    common = routing_common(destination, extra_headers, removed)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=routing_metadata(destination))


def streamed_body(body: bytes) -> list[pb.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: echo the held body back in chunks; the last one carries end_of_stream."""
    if not body:
        chunks = [b""]
    else:
        chunks = [body[i : i + STREAMED_CHUNK_BYTES] for i in range(0, len(body), STREAMED_CHUNK_BYTES)]
    last = len(chunks) - 1
    return [
        pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=i == last)
                    )
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


def passthrough_response_chunk(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED response bodies must be echoed to keep flowing (SSE stays unbuffered)."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
                )
            )
        )
    )


def replaced_response_chunk(body: bytes) -> pb.ProcessingResponse:
    """STREAMED mode (not full-duplex): this response chunk replaced by `body`."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=body))))


def error_body(status: int, code: str, message: str) -> bytes:
    """The JSON error contract: {"error": {"code", "message", "type"}} (OpenAI-like shape)."""
    return json.dumps({"error": {"code": code, "message": message, "type": "picker_error", "status": status}}).encode()


def immediate(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """Answer the client directly (no upstream), with a JSON body explaining why."""
    return immediate_json(status, error_body(status, code, message), f"picker_{code}", headers)


def immediate_json(status: int, body: bytes, details: str, headers: dict[str, str] | None = None
                   ) -> pb.ProcessingResponse:
    """Answer the client directly with a JSON body (an error, or what the picker itself answers)."""
    mutation = pb.HeaderMutation(set_headers=[header_option(names.CONTENT_TYPE, "application/json")])
    if headers:
        mutation.set_headers.extend(header_option(k, v) for k, v in headers.items())
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=mutation,
            body=body,
            details=details,
        )
    )
