"""The ext_proc state machine: one gRPC stream per HTTP request, in either supported body mode.

BUFFERED (recommended): headers are answered at once, the routing mutation rides on the body response. Where
nothing needs to hear the response begin (no P/D, no response bodies shown), that answer also turns the response
headers off for the stream: one message fewer per request; the stream still ends with the response.
FULL_DUPLEX_STREAMED (GIE's mode): headers are held until the body ends (its last chunk, or the request
trailers), then one HeadersResponse with the mutation is sent and the body is echoed back in chunks. Every
message Envoy may send is answered: request headers, body and trailers, response headers, body and trailers.
The response side is never changed (FULL_DUPLEX_STREAMED chunks are echoed as they come); it ends the
request's in-flight accounting and, when Envoy sends response bodies, yields token usage. The servicer knows
nothing of policy: it hands the headers and body to the Director.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from enum import Enum
from typing import Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError

from picker.core import headers as names
from picker.core.memory import AllocatorTrim
from picker.core.quietlog import QuietLog
from picker.core.requests import InferenceRequest, RequestError, route_kind
from picker.extproc import protocol as p
from picker.extproc.deadline import MovingDeadline
from picker.extproc.limits import BodyBudget, StreamLimits
from picker.routing.decision import Decision
from picker.routing.director import Director

log = logging.getLogger(__name__)


class Phase(Enum):
    """Where one stream is: START → BODY → ROUTED, or DONE once a refusal or a local answer (an immediate
    response) has ended it."""

    START = "start"  # waiting for the request headers
    BODY = "body"  # headers taken, the request body arriving
    ROUTED = "routed"  # the decision sent: the response side (in-flight accounting, usage) follows
    DONE = "done"  # an immediate response ended the stream


class ProtocolViolation(Exception):
    """Envoy (or a client pretending to be Envoy) sent messages in an order the protocol does not allow."""


def _headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    # Envoy puts values in raw_value (bytes); `value` is only used by very old Envoys.
    return {
        h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value) for h in message.headers.headers
    }


def _subset_hint(request: pb.ProcessingRequest) -> tuple[str, ...] | None:
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if p.SUBSET_NAMESPACE not in namespaces:
        return None
    value = namespaces[p.SUBSET_NAMESPACE].fields.get(p.SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        return tuple(v.string_value for v in value.list_value.values if v.string_value)
    if value.string_value:
        return tuple(s.strip() for s in value.string_value.split(",") if s.strip())
    return ()


class _Stream:
    """Per-HTTP-request state. `handle` returns the responses to send for one incoming message."""

    __slots__ = ("director", "max_body", "budget", "trim", "told_modes", "request_mode", "response_mode", "headers",
                 "subset", "body", "body_len", "held", "decision", "phase", "request_id", "generated_id")

    def __init__(self, director: Director, max_body: int, budget: BodyBudget, trim: AllocatorTrim) -> None:
        self.director = director
        self.max_body = max_body
        self.budget = budget
        self.trim = trim
        self.held = 0  # bytes of body taken from the shared budget
        self.told_modes = False  # Envoy named its body modes (protocol_config): only then may they be overridden
        self.request_mode = p.BUFFERED
        self.response_mode = p.NONE
        self.headers: dict[str, str] | None = None
        self.subset: tuple[str, ...] | None = None
        # The first chunk as it came (BUFFERED: the whole body, no copy); later ones appended to one growing
        # buffer, a single allocation the allocator hands back whole (many small chunks would fragment the heap).
        self.body: bytes | bytearray = b""
        self.body_len = 0
        self.decision: Decision | None = None
        self.phase = Phase.START
        self.request_id = ""
        self.generated_id = False

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.told_modes = True
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        subset = _subset_hint(message)
        if subset is not None:
            self.subset = subset
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._on_request_headers(message.request_headers)
        if kind == "request_body":
            return await self._on_request_body(message.request_body)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind == "response_headers":
            if self.decision is not None:
                body_follows = self.response_mode != p.NONE and not message.response_headers.end_of_stream
                self.director.response_started(self.decision, _headers_of(message.response_headers)
                                               if body_follows else None, body_follows)
            if message.response_headers.end_of_stream:
                self.release()
            return [p.EMPTY_RESPONSE_HEADERS]
        if kind == "response_body":
            chunk = message.response_body
            body = chunk.body
            changed = self.director.response_chunk(self.decision, body, chunk.end_of_stream) if self.decision \
                is not None else body
            if self.response_mode == p.FULL_DUPLEX_STREAMED:
                reply = p.passthrough_response_chunk(changed, chunk.end_of_stream)
            elif changed is not body:  # STREAMED or BUFFERED: a chunk is replaced only when it changes
                reply = p.replaced_response_chunk(changed)
            else:
                reply = p.EMPTY_RESPONSE_BODY
            if chunk.end_of_stream:
                self.release()
            return [reply]
        if kind == "response_trailers":
            self.release()
            return [p.EMPTY_RESPONSE_TRAILERS]
        raise ProtocolViolation(f"processing request carries no known message ({kind or 'empty'})")

    # Request side -------------------------------------------------------------------------------------

    async def _on_request_headers(self, message: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        if self.phase is not Phase.START:
            raise ProtocolViolation("request headers arrived twice")
        headers = self.headers = _headers_of(message)
        self.request_id = headers.get(names.REQUEST_ID, "")
        if not self.request_id:
            self.request_id = uuid.uuid4().hex
            self.generated_id = True
        try:
            api = route_kind(headers, has_body=not message.end_of_stream)
        except RequestError as err:
            return [self._reject(err)]
        if api is None:
            answer = self.director.answer_locally(headers)
            if answer is not None:
                self.phase = Phase.DONE
                return [p.immediate_json(200, answer, "picker_local_answer")]
            return [await self._route(b"", by_headers=True)]
        length = headers.get(names.CONTENT_LENGTH, "")
        if length.isdigit() and int(length) > self.max_body:
            return [self._reject(self._too_large(int(length)))]
        self.phase = Phase.BODY
        if self.request_mode == p.FULL_DUPLEX_STREAMED:
            return []  # hold the headers until the body is complete
        if self._response_unheard():
            return [p.REQUEST_HEADERS_RESPONSE_UNSEEN]
        return [p.EMPTY_REQUEST_HEADERS]

    def _response_unheard(self) -> bool:
        """Whether the response's headers may be turned off: Envoy buffers the request body and shows no response
        body, and the director needs no word of the response beginning (only its end, which the stream's end
        tells)."""
        return (self.told_modes and self.request_mode == p.BUFFERED and self.response_mode == p.NONE
                and not self.director.hears_response_start)

    async def _on_request_body(self, message: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.phase is not Phase.BODY:
            raise ProtocolViolation(f"request body arrived in phase {self.phase.value}")
        chunk = message.body  # a copy out of the protobuf message: take it once
        if chunk:
            size = len(chunk)
            self.body_len += size
            self.trim.body_bytes(size)
            if self.body_len > self.max_body:
                return [self._reject(self._too_large(self.body_len))]
            if not self.budget.take(size):
                return [self._reject(RequestError(
                    503, "buffers_full", f"the picker holds {self.budget.limit} bytes of request bodies already "
                    "(--max-buffered-bytes); retry shortly", {names.RETRY_AFTER: "1"}))]
            self.held += size
            if not self.body:
                self.body = chunk
            else:
                if isinstance(self.body, bytes):
                    self.body = bytearray(self.body)
                self.body += chunk
        if not message.end_of_stream:
            if self.request_mode == p.FULL_DUPLEX_STREAMED:
                return []
            return [p.EMPTY_REQUEST_BODY]
        return await self._finish_body()

    async def _on_request_trailers(self) -> list[pb.ProcessingResponse]:
        # Trailers end the body in streamed modes; answer them (GIE forgets, which stalls Envoy).
        responses = await self._finish_body() if self.phase is Phase.BODY else []
        if self.phase is Phase.DONE:  # refused: the immediate response ends the stream
            return responses
        return [*responses, p.EMPTY_REQUEST_TRAILERS]

    async def _finish_body(self) -> list[pb.ProcessingResponse]:
        body = self.body if isinstance(self.body, bytes) else bytes(self.body)
        self.body = b""
        self._give_back()  # routing is quick and bounded; the budget is for bodies waiting on their sender
        if self.request_mode == p.FULL_DUPLEX_STREAMED:
            routed = await self._route(body, by_headers=True)
            if routed.HasField("immediate_response"):
                return [routed]
            assert self.decision is not None
            return [routed, *p.streamed_body(body if self.decision.body is None else self.decision.body)]
        return [await self._route(body, by_headers=False)]

    async def _route(self, body: bytes, *, by_headers: bool) -> pb.ProcessingResponse:
        assert self.headers is not None
        try:
            self.decision = await self.director.route_http(self.headers, body, request_id=self.request_id,
                                                           subset=self.subset)
        except RequestError as err:
            return self._reject(err, counted=True)
        self.phase = Phase.ROUTED
        decision = self.decision
        extra = decision.set_headers
        if self.generated_id:
            extra = {**(extra or {}), names.REQUEST_ID: self.request_id}
        if by_headers:
            return p.route_by_headers(decision.destination, extra, decision.removed_headers)
        return p.route_by_body(decision.destination, extra, decision.removed_headers, decision.body)

    def _too_large(self, size: int) -> RequestError:
        return RequestError(413, "body_too_large", f"request body of {size} bytes exceeds the limit of "
                            f"{self.max_body} bytes (--max-body-bytes)")

    def _give_back(self) -> None:
        self.budget.give(self.held)
        self.held = 0

    def _reject(self, err: RequestError, *, counted: bool = False) -> pb.ProcessingResponse:
        self.phase = Phase.DONE
        self.body = b""
        self._give_back()
        if not counted:  # the director counts what it refuses itself
            self.director.refused(InferenceRequest(request_id=self.request_id, model="",
                                                   path=(self.headers or {}).get(":path", "")), err)
        log.info("request %s refused: %d %s: %s", self.request_id, err.status, err.code, err.message)
        return p.immediate(err.status, err.code, err.message, err.headers)

    def release(self) -> None:
        """The stream ended, however: its body bytes go back to the budget, its request leaves the in-flight
        count (once)."""
        self._give_back()
        if self.decision is not None:
            self.director.release(self.decision)


def go_code_name(code: grpc.StatusCode) -> str:
    """A status as the reference picker's stream series label it (Go's names: OK, Canceled, DeadlineExceeded)."""
    if code is grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "".join(part.capitalize() for part in code.name.split("_")) if code is not grpc.StatusCode.OK else "OK"


class StreamObserver(Protocol):
    """Hears of the servicer's streams (the serving assembly's metrics)."""

    def watch_buffered(self, held: Callable[[], float]) -> None:
        """`held()`: the request-body bytes the streams hold now."""
        ...

    def stream_opened(self) -> None: ...

    def stream_closed(self, code: str, seconds: float) -> None:
        """A stream ended with gRPC status `code` (its Go name) after `seconds`."""
        ...

    def stream_failed(self, reason: str) -> None:
        """A stream ended by an error: malformed, protocol, timeout or internal."""
        ...


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor/Process`: one bidirectional stream per HTTP request.

    A stream that ends in an error is counted by reason; its log line is capped (`QuietLog`), because anyone who
    reaches the port can send garbage. Tracebacks of malformed input only at DEBUG.
    """

    def __init__(self, director: Director, limits: StreamLimits, metrics: StreamObserver | None = None) -> None:
        self.director = director
        self.limits = limits
        self.budget = BodyBudget(limits.max_buffered)
        self.trim = AllocatorTrim.from_libc()
        self.metrics = metrics
        if metrics is not None:
            metrics.watch_buffered(lambda: self.budget.held)
        self.quiet = QuietLog(log)

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # context.read()/write() instead of an async generator: fewer tasks and wake-ups per message.
        stream = _Stream(self.director, self.limits.max_body, self.budget, self.trim)
        loop = asyncio.get_running_loop()
        idle, routed_at, opened_at = self.limits.idle_timeout, 0.0, loop.time()
        observer = self.metrics
        if observer is not None:
            observer.stream_opened()
        code = grpc.StatusCode.CANCELLED  # unless it ends otherwise: Envoy (or its client) went away
        try:
            # One deadline per stream, moved on as messages come: idle_timeout until the decision, then at most
            # request_timeout from it (a held stream stops counting in flight).
            with MovingDeadline(loop, loop.time() + idle) as deadline:
                while True:
                    message = await context.read()
                    if message is grpc.aio.EOF:
                        code = grpc.StatusCode.OK
                        return
                    responses = await stream.handle(message)
                    del message  # a body chunk's parsed copy: not held while this stream waits for its next one
                    for response in responses:
                        await context.write(response)
                    if stream.phase is Phase.DONE:
                        code = grpc.StatusCode.OK
                        return
                    if stream.phase is not Phase.ROUTED:
                        deadline.move(loop.time() + idle)
                    elif not routed_at:
                        routed_at = loop.time()
                        deadline.move(routed_at + self.limits.request_timeout)
        except TimeoutError:
            what = "routed request outlived --request-timeout" if routed_at else "stream idle past --stream-idle-timeout"
            self._failed("timeout", "ext_proc %s", what)
            code = self._end(context, grpc.StatusCode.DEADLINE_EXCEEDED, what)
        except DecodeError as exc:
            self._failed("malformed", "ext_proc stream sent a message that is no ProcessingRequest: %s", exc)
            code = self._end(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed ext_proc message")
        except ProtocolViolation as exc:
            self._failed("protocol", "ext_proc protocol violation: %s", exc)
            code = self._end(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            # Never let one bad stream take the server down; Envoy applies its failure mode.
            self._failed("internal", "ext_proc stream failed: %r", exc, level=logging.ERROR, traceback=True)
            code = self._end(context, grpc.StatusCode.INTERNAL, "picker internal error")
        finally:
            stream.release()
            if observer is not None:
                observer.stream_closed(go_code_name(code), loop.time() - opened_at)

    @staticmethod
    def _end(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> grpc.StatusCode:
        """End the stream with a status by returning: abort() raises from inside the except block, and the
        exception's traceback keeps the stream's frames in a cycle only a full collection frees."""
        context.set_code(code)
        context.set_details(details)
        return code

    def _failed(self, reason: str, message: str, exc: object, *, level: int = logging.WARNING,
                traceback: bool = False) -> None:
        if self.metrics is not None:
            self.metrics.stream_failed(reason)
        self.quiet.log(level, message, exc, exc_info=traceback or log.isEnabledFor(logging.DEBUG))
