"""What the request path reports, declared here so the layers above implement it (the serving assembly's
Prometheus metrics and OpenTelemetry traces) and the director imports nothing above it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from picker.core.requests import InferenceRequest, Usage
from picker.endpoints.state import Endpoint
from picker.scheduling.types import Disaggregation


@dataclass(slots=True)
class ResponseTrace:
    """What the stream saw of a response whose body Envoy showed the picker: when its chunks came, how big it was,
    and the picker's own time handling them (the reference's response-side series)."""

    started_at: float  # the request's start, on the director's clock
    itl: Callable[[float], None] | None = None  # hears each gap between chunks of a stream (inter-token latency)
    first_chunk_at: float = -1.0
    last_chunk_at: float = -1.0
    bytes: int = 0
    chunks: int = 0
    handling_s: float = 0.0

    def on_chunk(self, now: float, size: int, handling_s: float) -> None:
        if self.chunks == 0:
            self.first_chunk_at = now
        elif size and self.itl is not None:
            self.itl(now - self.last_chunk_at)
        if size:
            self.last_chunk_at = now
            self.chunks += 1
            self.bytes += size
        self.handling_s += handling_s



class RequestObserver(Protocol):
    """Hears what happens to each request the director handles."""

    def observe_routed(self, request: InferenceRequest, seconds: float, matched_blocks: int, blocks: int,
                       endpoint: Endpoint | None = None, block_chars: int = 0,
                       disaggregation: Disaggregation | None = None) -> None:
        """Scheduled on `endpoint` in `seconds`; the index matched `matched_blocks` of its `blocks`; with P/D,
        where it is prefilled."""
        ...

    def observe_refused(self, request: InferenceRequest, code: str, scheduling: bool = False) -> None:
        """Refused with `code`; `scheduling`: no endpoint was found for it."""
        ...

    def observe_processing(self, seconds: float) -> None:
        """The picker's time from a complete request to its decision (waits included)."""
        ...

    def observe_finished(self, request: InferenceRequest, seconds: float, usage: Usage | None,
                         response: ResponseTrace | None = None) -> None:
        """Ended after `seconds`, with the usage and response timing Envoy let the picker see."""
        ...

    def itl_observer(self, request: InferenceRequest) -> Callable[[float], None] | None:
        """Where a streamed response's chunk gaps go; None when nobody listens."""
        ...

    def observe_prefix_hit(self, endpoint: Endpoint, expected_tokens: int, reported_tokens: int) -> None:
        """What the index expected the pod to have cached for a request, and what the pod reported."""
        ...


class DecisionRecorder(Protocol):
    """Records one span per decision (OpenTelemetry in `picker serve`)."""

    def record(self, start_ns: int, end_ns: int, attributes: dict[str, str | int | float]) -> None: ...
