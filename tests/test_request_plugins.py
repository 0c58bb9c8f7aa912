"""A feature that changes the request or reads the response is one plugin and one line of the table: here a test's
own, served by the real servicer over gRPC, beside the product's. It sets a header on the pod's request, marks the
response's last chunk, keeps its per-request state in the Decision, and hears each request end once."""

from __future__ import annotations

import json
import random

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint
from picker.extproc.limits import StreamLimits
from picker.extproc.servicer import ExtProcServicer
from picker.routing import plugins
from picker.routing.decision import Decision
from picker.routing.director import Director
from picker.routing.lifecycle import PluginDeps, RequestPlugin
from picker.scheduling.config import build_scheduler
from tests.test_extproc_grpc import body_msg, exchange, headers_msg


class ChunkCounter(RequestPlugin):
    """The test's feature: `x-picker-profile` on the pod's request, the chunk count appended to the response."""

    name = "chunk-counter"

    def __init__(self) -> None:
        self.ended: list[int] = []

    def placed(self, decision: Decision, body: bytes) -> None:
        profile = decision.result.profile if decision.result is not None else ""
        decision.set_header("x-picker-profile", profile)
        decision.keep(self.name, 0)

    def response_chunk(self, decision: Decision, chunk: bytes, end: bool, began: float) -> bytes:
        seen = decision.kept(self.name) + 1
        decision.keep(self.name, seen)
        return chunk + f"chunks: {seen}\n".encode() if end else chunk

    def finished(self, decision: Decision) -> None:
        self.ended.append(decision.kept(self.name))


async def test_a_plugin_added_to_the_table_acts_at_each_point_of_a_request() -> None:
    counter = ChunkCounter()
    pool = EndpointPool()
    pods = [Endpoint.from_address("10.0.0.1:8000"), Endpoint.from_address("10.0.0.2:8000")]
    pool.set_endpoints(pods)
    for endpoint in pods:
        pool.mark_ready(endpoint)
    scheduler = build_scheduler(rng=random.Random(0))
    table = {**plugins.REQUEST_PLUGINS, counter.name: lambda deps: counter}
    director = Director(pool, scheduler, plugins=plugins.build(PluginDeps(scheduler, lambda: 0.0), table))
    assert [p.name for p in director.plugins] == ["model-rewrite", "data-parallel", "chunk-counter"]  # no P/D, metrics, tracer
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(director, StreamLimits()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        streamed = pm.ProcessingMode.STREAMED
        body = json.dumps({"model": "tiny", "prompt": "hello"}).encode()
        responses = await exchange(port, [
            headers_msg("/v1/completions", mode=pm.ProcessingMode.BUFFERED, response_mode=streamed), body_msg(body),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n", end_of_stream=False)),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))])
    finally:
        await server.stop(0)
    routed = responses[1].request_body.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in routed}["x-picker-profile"] == "bursty-chat"
    chunks = [r.response_body.response for r in responses if r.WhichOneof("response") == "response_body"]
    assert not chunks[0].HasField("body_mutation")  # unchanged: nothing to replace
    assert chunks[1].body_mutation.body == b"data: [DONE]\n\nchunks: 2\n"
    assert counter.ended == [2]  # once, with the state it kept for this request
