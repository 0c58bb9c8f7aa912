"""OpenTelemetry tracing of decisions (routing.observers.DecisionRecorder): one span per decision, exported over
OTLP/HTTP with JSON encoding."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger(__name__)


def _otlp_value(value: object) -> dict[str, object]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # int64 travels as a string in OTLP/JSON
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


class OtlpJsonExporter(SpanExporter):
    """OTLP/HTTP with JSON encoding (`POST {endpoint}/v1/traces`), which every OpenTelemetry Collector accepts.

    Written against the OTLP spec rather than pulling in the protobuf exporter: its `opentelemetry.proto`
    modules collide with the older copies xds-protos installs at the same import path.
    Runs on the batch processor's worker thread, never on the event loop.
    """

    def __init__(self, endpoint: str, service_name: str, timeout: float = 5.0) -> None:
        self.url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/v1/traces") else "/v1/traces")
        self.resource = [{"key": "service.name", "value": {"stringValue": service_name}}]
        self.timeout = timeout

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        payload = {"resourceSpans": [{"resource": {"attributes": self.resource}, "scopeSpans": [{
            "scope": {"name": "picker"},
            "spans": [{
                "traceId": f"{span.context.trace_id:032x}", "spanId": f"{span.context.span_id:016x}",
                "name": span.name, "kind": 1,
                "startTimeUnixNano": str(span.start_time), "endTimeUnixNano": str(span.end_time),
                "attributes": [{"key": k, "value": _otlp_value(v)} for k, v in (span.attributes or {}).items()],
            } for span in spans if span.context is not None]}]}]}
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except OSError as exc:
            log.warning("trace export to %s failed: %s", self.url, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class DecisionTracer:
    """One OpenTelemetry span per routing decision (start → pick), exported over OTLP/HTTP (JSON).

    Spans are built after the decision from recorded timestamps, so tracing adds no await on the hot path.
    """

    def __init__(self, otlp_endpoint: str, service_name: str = "picker", export_delay_ms: int = 1000) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OtlpJsonExporter(otlp_endpoint, service_name)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=export_delay_ms))
        self.tracer = self.provider.get_tracer("picker")

    def record(self, start_ns: int, end_ns: int, attributes: dict[str, str | int | float]) -> None:
        span = self.tracer.start_span("picker.route", start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush buffered spans (graceful stop)."""
        self.provider.shutdown()
