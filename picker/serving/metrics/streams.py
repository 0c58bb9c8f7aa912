"""The ext_proc streams' series (extproc.servicer.StreamObserver): bytes held while bodies arrive, streams ended
by an error and, with `--enable-grpc-stream-metrics` (the reference picker's flag), streams open, their
durations and the gRPC status each ended with."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from picker.serving.metrics.labels import LATENCY_BUCKETS


class StreamMetrics:
    def __init__(self, r: CollectorRegistry, per_stream: bool) -> None:
        self.buffered_bytes = Gauge("picker_buffered_request_bytes",
                                    "Request-body bytes the ext_proc streams hold while their bodies arrive "
                                    "(capped by --max-buffered-bytes).", registry=r)
        self.stream_errors = Counter("picker_extproc_stream_errors",
                                     "ext_proc streams ended by an error, by reason (malformed: a message that is no "
                                     "protobuf; protocol: messages out of order; internal: a picker fault).",
                                     ["reason"], registry=r)
        self.per_stream = per_stream
        self.last_opened = -float("inf")  # monotonic time the newest stream opened: a stopping picker waits for quiet
        if per_stream:
            self.open = Gauge("llm_d_epp_extproc_streams_inflight", "ext_proc streams open now.", registry=r)
            self.duration = Histogram("llm_d_epp_extproc_stream_duration_seconds",
                                      "How long each ext_proc stream lasted.", buckets=LATENCY_BUCKETS, registry=r)
            self.ended = Counter("llm_d_epp_extproc_streams", "ext_proc streams ended, by gRPC status.", ["code"],
                                 registry=r)

    def watch_buffered(self, held: Callable[[], float]) -> None:
        """The bytes the streams hold, read at scrape time."""
        self.buffered_bytes.set_function(held)

    def stream_opened(self) -> None:
        self.last_opened = time.monotonic()
        if self.per_stream:
            self.open.inc()

    def stream_closed(self, code: str, seconds: float) -> None:
        """A stream ended with gRPC status `code` (its Go name) after `seconds`."""
        if self.per_stream:
            self.open.dec()
            self.duration.observe(seconds)
            self.ended.labels(code).inc()

    def stream_failed(self, reason: str) -> None:
        self.stream_errors.labels(reason).inc()
