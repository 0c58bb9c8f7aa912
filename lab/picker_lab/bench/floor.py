"""The floor of an ext_proc picker's cost: an ExternalProcessor that only routes, on grpc.aio or on grpclib.

It answers every message Envoy sends as the picker does in BUFFERED mode (turning the response headers off, as
the picker does without P/D), and puts the next pod of the pool (round-robin) in the destination header of the body
response, with the same response builders; it parses no body, schedules nothing and counts nothing. It also serves
the gRPC health Envoy checks. `make overhead` measures the picker and this server behind the same Envoy config in
one run: the difference is the picker's own work. `--server grpclib` serves the same answers from grpclib, whose
HTTP/2 and gRPC framing run in Python on the event loop with no gRPC core threads: what the server library itself
costs, measured beside grpc.aio (the picker's).

    python -m picker_lab.bench.floor --grpc-port 9002 --health-port 9003 --pool 10.0.0.5:8000,10.0.0.6:8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc
import grpclib.const
import grpclib.server
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.extproc import protocol as p
from picker_lab.supervisor import (
    Managed,
    Picker,
    free_ports,
    port_open,
    python_module,
    spawn,
    wait_until,
)

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
SERVERS = ("grpcio", "grpclib")
_ANSWERS = {
    "request_trailers": p.EMPTY_REQUEST_TRAILERS,
    "response_headers": p.EMPTY_RESPONSE_HEADERS,
    "response_body": p.EMPTY_RESPONSE_BODY,
    "response_trailers": p.EMPTY_RESPONSE_TRAILERS,
}


def answer(message: pb.ProcessingRequest, pods: Iterator[str]) -> pb.ProcessingResponse | None:
    """The floor's answer to one message (None: nothing to answer), routing round-robin over `pods`."""
    kind = message.WhichOneof("request")
    if kind == "request_headers":
        if message.request_headers.end_of_stream:
            return p.route_by_headers(next(pods))
        return p.REQUEST_HEADERS_RESPONSE_UNSEEN
    if kind == "request_body":
        return p.route_by_body(next(pods))
    return _ANSWERS.get(kind or "")


class FloorProcessor(pb_grpc.ExternalProcessorServicer):
    """Round-robin routing over `pool`, nothing else (grpc.aio)."""

    def __init__(self, pool: Sequence[str]) -> None:
        self._next = itertools.cycle(pool)

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            response = answer(message, self._next)
            if response is not None:
                yield response


class GrpclibFloor:
    """The same answers from grpclib."""

    def __init__(self, pool: Sequence[str]) -> None:
        self._next = itertools.cycle(pool)

    async def process(self, stream: grpclib.server.Stream[pb.ProcessingRequest, pb.ProcessingResponse]) -> None:
        async for message in stream:
            response = answer(message, self._next)
            if response is not None:
                await stream.send_message(response)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {PROCESS_METHOD: grpclib.const.Handler(self.process, grpclib.const.Cardinality.STREAM_STREAM,
                                                      pb.ProcessingRequest, pb.ProcessingResponse)}


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


# Each library's health service is imported where it is served: both register grpc.health.v1's messages, and one
# process cannot hold the two.

async def serve(host: str, grpc_port: int, health_port: int, pool: Sequence[str]) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

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
    await _until_signalled()
    await server.stop(1)
    await health_server.stop(1)


async def serve_grpclib(host: str, grpc_port: int, health_port: int, pool: Sequence[str]) -> None:
    import grpclib.health.service

    floor = GrpclibFloor(pool)
    server = grpclib.server.Server([floor])
    health_server = grpclib.server.Server([grpclib.health.service.Health({floor: []})])  # its service and ""
    await server.start(host, grpc_port)
    await health_server.start(host, health_port)
    await _until_signalled()
    for each in (server, health_server):
        each.close()
        await each.wait_closed()


def start(logdir: Path, pool: Sequence[str], started: list[Managed], server: str = "grpcio") -> Picker:
    """This floor in its own process on `server`'s library (appended to `started`), shaped as the Picker an Envoy
    config needs (its ports, plaintext)."""
    grpc_port, health_port = free_ports(2)
    process = spawn(f"floor-{server}", [*python_module("picker_lab.bench.floor"), "--grpc-port", str(grpc_port),
                                        "--health-port", str(health_port), "--pool", ",".join(pool),
                                        "--server", server], logdir)
    started.append(process)
    wait_until(lambda: port_open(grpc_port) and port_open(health_port), 30, "floor ext_proc server", process.proc)
    return Picker(grpc_port, health_port, 0, process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--health-port", type=int, required=True)
    parser.add_argument("--pool", required=True, help="comma-separated ip:port of the pods")
    parser.add_argument("--server", choices=SERVERS, default="grpcio", help="the gRPC server library")
    args = parser.parse_args()
    run = serve if args.server == "grpcio" else serve_grpclib
    asyncio.run(run(args.host, args.grpc_port, args.health_port, [a for a in args.pool.split(",") if a]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
