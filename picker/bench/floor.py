"""The floor of an ext_proc picker's cost: a grpc.aio ExternalProcessor that only routes.

It answers every message Envoy sends as the picker does in BUFFERED mode (turning the response headers off, as
the picker does without P/D), and puts the next pod of the pool (round-robin) in the destination header of the body
response, with the same response builders; it parses no body, schedules nothing and counts nothing. It also serves the gRPC health Envoy checks. `make overhead` measures the
picker and this server behind the same Envoy config in one run: the difference is the picker's own work.

    python -m picker.bench.floor --grpc-port 9002 --health-port 9003 --pool 10.0.0.5:8000,10.0.0.6:8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator, Sequence

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.extproc import protocol as p

_ANSWERS = {
    "request_trailers": p.EMPTY_REQUEST_TRAILERS,
    "response_headers": p.EMPTY_RESPONSE_HEADERS,
    "response_body": p.EMPTY_RESPONSE_BODY,
    "response_trailers": p.EMPTY_RESPONSE_TRAILERS,
}


class FloorProcessor(pb_grpc.ExternalProcessorServicer):
    """Round-robin routing over `pool`, nothing else."""

    def __init__(self, pool: Sequence[str]) -> None:
        self._next = itertools.cycle(pool)

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                headers_only = message.request_headers.end_of_stream
                yield p.route_by_headers(next(self._next)) if headers_only else p.REQUEST_HEADERS_RESPONSE_UNSEEN
            elif kind == "request_body":
                yield p.route_by_body(next(self._next))
            elif kind in _ANSWERS:
                yield _ANSWERS[kind]


async def serve(host: str, grpc_port: int, health_port: int, pool: Sequence[str]) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor(pool), server)
    server.add_insecure_port(f"{host}:{grpc_port}")
    health_server = grpc.aio.server()
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, health_server)
    health_server.add_insecure_port(f"{host}:{health_port}")
    for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor", "liveness", "readiness"):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    await health_server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)
    await health_server.stop(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--health-port", type=int, required=True)
    parser.add_argument("--pool", required=True, help="comma-separated ip:port of the pods")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.grpc_port, args.health_port, [a for a in args.pool.split(",") if a]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
