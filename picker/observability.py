"""Prometheus metrics (GIE-compatible names) and OpenTelemetry tracing for decisions.

One `PickerMetrics` per server, on its own registry, so several pickers can live in one process (tests,
benchmarks) without clashing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from picker import __version__
from picker.endpoints.state import Endpoint
from picker.requests import InferenceRequest, Usage

if TYPE_CHECKING:
    from picker.prefix.shared import SyncStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
_SCHEDULER_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
_SIZE_BUCKETS = tuple(float(2**k) for k in range(6, 25, 2))  # 64 B .. 16 MiB
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072)


OTHER_MODEL = "other"


class ModelLabels:
    """Which model names may become metric label values: those the pool's pods serve (their series'
    `model_name`, their loaded LoRA adapters) and those configured (`scheduling.models`); any other name a client
    sends counts as "other". A client must not be able to grow /metrics (and the picker's memory) with made-up
    model names; `limit` caps the set even if pods report thousands of adapters."""

    __slots__ = ("configured", "limit", "_allowed")

    def __init__(self, configured: Iterable[str] = (), limit: int = 512) -> None:
        self.configured = frozenset(configured)
        self.limit = limit
        self._allowed = self.configured | {""}  # "": refused before its model was read

    def learn(self, endpoints: Iterable[Endpoint]) -> None:
        """Add what the latest scrapes report (called with every pool refresh). Never removes: a label a routed
        request was counted under stays the one its end is counted under."""
        allowed = set(self._allowed)
        for endpoint in endpoints:
            m = endpoint.metrics
            for name in (*m.models, *m.running_loras, *m.waiting_loras):
                if len(allowed) >= self.limit:
                    break
                allowed.add(name)
        if len(allowed) != len(self._allowed):
            self._allowed = frozenset(allowed)

    def label(self, model: str) -> str:
        return model if model in self._allowed else OTHER_MODEL


class PickerMetrics:
    """The picker's own series. Label sets follow GIE so existing dashboards keep working."""

    def __init__(self, pool_name: str = "default", registry: CollectorRegistry | None = None,
                 models: Iterable[str] = ()) -> None:
        self.registry = registry or CollectorRegistry()
        self.pool_name = pool_name
        self.models = ModelLabels(models)
        r = self.registry
        labels = ["model_name", "target_model_name", "priority"]
        self.requests = Counter("inference_objective_request", "Requests routed or refused, by model and priority.",
                                labels, registry=r)
        self.errors = Counter("inference_objective_request_error", "Requests refused by the picker, by error code.",
                              [*labels, "error_code"], registry=r)
        self.running = Gauge("inference_objective_running_requests", "Requests routed and not finished, by model.",
                             ["model_name"], registry=r)
        self.request_sizes = Histogram("inference_objective_request_sizes", "Request body sizes in bytes.",
                                       ["model_name", "target_model_name"], buckets=_SIZE_BUCKETS, registry=r)
        self.info = Gauge("inference_extension_info", "The picker's build: always 1.", ["commit", "build_ref"],
                          registry=r)
        self.info.labels("", f"picker-{__version__}").set(1)
        self.duration = Histogram("inference_objective_request_duration_seconds",
                                  "Request duration from headers to end of response, seen by the picker.",
                                  labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.input_tokens = Histogram("inference_objective_input_tokens", "Prompt tokens reported in usage.",
                                      ["model_name", "target_model_name"], buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("inference_objective_output_tokens", "Completion tokens reported in usage.",
                                       ["model_name", "target_model_name"], buckets=_TOKEN_BUCKETS, registry=r)
        self.scheduler_duration = Histogram("inference_extension_scheduler_e2e_duration_seconds",
                                            "Time to schedule one request (filters, scorers, pick).",
                                            buckets=_SCHEDULER_BUCKETS, registry=r)
        self.avg_kv = Gauge("inference_pool_average_kv_cache_utilization", "Mean KV-cache utilisation of ready pods.",
                            ["name"], registry=r)
        self.avg_queue = Gauge("inference_pool_average_queue_size", "Mean waiting requests of ready pods.",
                               ["name"], registry=r)
        self.pod_queue = Gauge("inference_pool_per_pod_queue_size", "Waiting requests per pod.",
                               ["name", "model_server_pod"], registry=r)
        self.ready_pods = Gauge("inference_pool_ready_pods", "Pods the picker may route to.", ["name"], registry=r)
        self.in_flight = Gauge("picker_endpoint_in_flight_requests", "Requests the picker routed that have not finished.",
                               ["name", "model_server_pod"], registry=r)
        self.index_size = Gauge("inference_extension_prefix_indexer_size", "Entries in the prefix index.",
                                registry=r)
        self.index_hit_ratio = Histogram("inference_extension_prefix_indexer_hit_ratio",
                                         "Share of a request's prefix blocks the chosen pod already holds (index view).",
                                         buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.prompt_tokens = Counter("picker_response_prompt_tokens", "Prompt tokens in responses' usage.",
                                     ["model_name"], registry=r)
        self.cached_tokens = Counter("picker_response_cached_tokens",
                                     "Prompt tokens the model server served from its prefix cache "
                                     "(usage.prompt_tokens_details.cached_tokens).", ["model_name"], registry=r)
        self.scrapes = Counter("picker_model_server_scrapes",
                               "/metrics requests this picker made to each model server (what our signals cost "
                               "the pods), by result.", ["name", "model_server_pod", "result"], registry=r)
        # Predicted TTFT (the predicted-ttft scorer) against the pods' own vllm:time_to_first_token_seconds
        self.ttft_predicted = Gauge("picker_ttft_predicted_seconds",
                                    "Mean predicted TTFT of the requests routed to the pod in its last scrape interval.",
                                    ["name", "model_server_pod"], registry=r)
        self.ttft_observed = Gauge("picker_ttft_observed_seconds",
                                   "Mean TTFT the pod measured (vllm:time_to_first_token_seconds) in the same interval.",
                                   ["name", "model_server_pod"], registry=r)
        self.ttft_prediction_ratio = Histogram("picker_ttft_prediction_ratio",
                                               "Predicted / measured mean TTFT per pod and scrape interval "
                                               "(1 = exact; how far to trust the predicted-ttft scorer).",
                                               ["name"], buckets=_RATIO_BUCKETS, registry=r)
        self.buffered_bytes = Gauge("picker_buffered_request_bytes",
                                    "Request-body bytes the ext_proc streams hold while their bodies arrive "
                                    "(capped by --max-buffered-bytes).", registry=r)
        self.stream_errors = Counter("picker_extproc_stream_errors",
                                     "ext_proc streams ended by an error, by reason (malformed: a message that is no "
                                     "protobuf; protocol: messages out of order; internal: a picker fault).",
                                     ["reason"], registry=r)
        self.pool_prefix_hit_ratio = Gauge("picker_pool_prefix_cache_hit_ratio",
                                           "Prefix-cache hit ratio of the pool from vLLM counters (hits/queries, tokens); "
                                           "a signal for autoscaling.", ["name"], registry=r)

    def _labels(self, request: InferenceRequest) -> tuple[str, str, str]:
        """model_name, target_model_name, priority of a request, its model names bounded by `models`."""
        model = self.models.label(request.model)
        return model, self.models.label(request.target_model) if request.target_model else model, \
            str(request.priority)

    def observe_routed(self, request: InferenceRequest, seconds: float, matched_blocks: int, blocks: int) -> None:
        self.scheduler_duration.observe(seconds)
        model, target, priority = self._labels(request)
        self.requests.labels(model, target, priority).inc()
        self.request_sizes.labels(model, target).observe(request.body_bytes)
        self.running.labels(model).inc()
        if blocks:
            self.index_hit_ratio.observe(matched_blocks / blocks)

    def observe_refused(self, request: InferenceRequest, code: str) -> None:
        labels = self._labels(request)
        self.requests.labels(*labels).inc()
        self.errors.labels(*labels, code).inc()

    def observe_finished(self, request: InferenceRequest, seconds: float, usage: Usage | None) -> None:
        """A request's duration, and the token usage the model server reported when the body was visible."""
        model, target, priority = self._labels(request)
        self.duration.labels(model, target, priority).observe(seconds)
        self.running.labels(model).dec()
        if usage is not None:
            self.input_tokens.labels(model, target).observe(usage.prompt_tokens)
            self.output_tokens.labels(model, target).observe(usage.completion_tokens)
            self.prompt_tokens.labels(model).inc(usage.prompt_tokens)
            self.cached_tokens.labels(model).inc(usage.cached_tokens)

    def observe_prediction(self, endpoint: Endpoint, predicted_s: float, observed_s: float) -> None:
        """PredictionObserver: one pod's predicted and measured mean TTFT over a scrape interval."""
        self.ttft_predicted.labels(self.pool_name, endpoint.name).set(predicted_s)
        self.ttft_observed.labels(self.pool_name, endpoint.name).set(observed_s)
        if observed_s > 0:
            self.ttft_prediction_ratio.labels(self.pool_name).observe(predicted_s / observed_s)

    def observe_scrape(self, endpoint: Endpoint, ok: bool) -> None:
        self.scrapes.labels(self.pool_name, endpoint.name, "ok" if ok else "error").inc()

    def observe_pool(self, endpoints: Iterable[Endpoint]) -> None:
        """Refresh pool gauges from the latest endpoint state (called after each scrape round)."""
        endpoints = list(endpoints)
        self.models.learn(endpoints)
        ready = [e for e in endpoints if e.healthy]
        name = self.pool_name
        self.ready_pods.labels(name).set(len(ready))
        if ready:
            self.avg_kv.labels(name).set(sum(e.metrics.kv_usage for e in ready) / len(ready))
            self.avg_queue.labels(name).set(sum(e.metrics.waiting for e in ready) / len(ready))
        queries = sum(e.metrics.prefix_queries for e in ready)
        hits = sum(e.metrics.prefix_hits for e in ready)
        self.pool_prefix_hit_ratio.labels(name).set(hits / queries if queries else 0.0)
        for e in ready:
            self.pod_queue.labels(name, e.name).set(e.metrics.waiting)
            self.in_flight.labels(name, e.name).set(e.in_flight)

    def watch_index_sync(self, stats: SyncStats) -> None:
        """Export a shared index's replication counters, read at scrape time."""
        self.registry.register(_IndexSyncCollector(stats))

    def forget_pod(self, endpoint: Endpoint) -> None:
        for gauge in (self.pod_queue, self.in_flight, self.ttft_predicted, self.ttft_observed):
            with contextlib.suppress(KeyError):
                gauge.remove(self.pool_name, endpoint.name)
        for result in ("ok", "error"):  # a departed pod's series go with it (pod churn must not grow /metrics)
            with contextlib.suppress(KeyError):
                self.scrapes.remove(self.pool_name, endpoint.name, result)


class _IndexSyncCollector(Collector):
    def __init__(self, stats: SyncStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        entries = CounterMetricFamily("picker_prefix_index_sync_entries",
                                      "Shared prefix index entries published to Redis (sent), applied from other "
                                      "replicas (received), or dropped while Redis was unreachable.",
                                      labels=["direction"])
        for direction, value in (("sent", s.sent), ("received", s.received), ("dropped", s.dropped)):
            entries.add_metric([direction], value)
        yield entries
        yield CounterMetricFamily("picker_prefix_index_sync_errors", "Failed Redis calls of the shared prefix index.",
                                  value=s.errors)
        yield GaugeMetricFamily("picker_prefix_index_sync_lag_seconds",
                                "Age of the newest entry from another replica when it was applied.",
                                value=s.lag_seconds)
        yield GaugeMetricFamily("picker_prefix_index_sync_connected", "1 while Redis answers, else 0.",
                                value=1.0 if s.connected else 0.0)


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
