"""Decision spans reach a real OTLP/gRPC collector endpoint (a collector stand-in on loopback)."""

from __future__ import annotations

import asyncio
import json

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from picker.supervisor import free_port, process_scope, start_backends, start_picker
from tests.test_extproc_grpc import body_msg, exchange, headers_msg


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[dict[str, object]] = []

    async def Export(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attrs = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                    self.spans.append({"name": span.name, **attrs})
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_each_decision_is_a_span() -> None:
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    try:
        with process_scope("tracing") as (logdir, started):
            backends = start_backends(2, logdir)
            started.append(backends.process)
            picker = start_picker(logdir, endpoints=backends.addresses,
                                  extra=["--otlp-endpoint", f"http://127.0.0.1:{port}"])
            started.append(picker.process)
            body = json.dumps({"model": "tiny", "prompt": "trace me"}).encode()
            await exchange(picker.grpc_port, [headers_msg("/v1/completions", extra={"x-request-id": "span-1"}),
                                              body_msg(body)])
            await exchange(picker.grpc_port, [headers_msg(extra={"x-request-id": "span-2"}), body_msg(b"{")])
            for _ in range(100):
                if len(collector.spans) >= 2:
                    break
                await asyncio.sleep(0.1)
    finally:
        await server.stop(0)
    by_id = {s["picker.request_id"]: s for s in collector.spans}
    assert by_id["span-1"]["name"] == "picker.route"
    assert by_id["span-1"]["picker.destination"] in backends.addresses
    assert by_id["span-1"]["gen_ai.request.model"] == "tiny"
    assert by_id["span-2"]["picker.error.code"] == "invalid_json"
