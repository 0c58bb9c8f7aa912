"""Prometheus metrics (the reference picker's names, current and deprecated) and OpenTelemetry tracing for
decisions.

One `PickerMetrics` per server, on its own registry, so several pickers can live in one process (tests,
benchmarks) without clashing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from picker import __version__
from picker.endpoints.state import Endpoint, EndpointState
from picker.metric_twins import Twin, TwinCollector
from picker.requests import InferenceRequest, Usage

if TYPE_CHECKING:
    from picker.flowcontrol.controller import FlowController
    from picker.kvevents.relay import RelayStats
    from picker.kvevents.subscriber import SubscriberStats
    from picker.prefix.precise import PreciseIndex
    from picker.prefix.shared import SyncStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                    45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
_SCHEDULER_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
_SIZE_BUCKETS = tuple(float(2**k) for k in range(6, 25, 2))  # 64 B .. 16 MiB
_TOKEN_TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
PLUGIN_TIMING_EVERY = 16  # plugins are timed on one request in this many: timing each would tax the hot path
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


# The reference picker's labels of request series; fairness_id is the flow-control tenant the request names
# (x-llm-d-inference-fairness-id), empty when it names none.
REQUEST_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")
FLOW_LABELS = ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")
NO_FAIRNESS_ID = ""


class FirstSeenLabels:
    """Label values a client chooses (fairness ids), bounded as the reference bounds them: the first `limit`
    distinct values are kept, any later one counts as "other"."""

    __slots__ = ("limit", "_seen")

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._seen: set[str] = {""}

    def label(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER_MODEL


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


class _RequestSeries:
    """The children of the request series for one label set, looked up once per event instead of per series.
    The response-side ones are made on first use: a series never observed (no response bodies in buffered mode)
    must not put empty histograms on /metrics."""

    __slots__ = ("labels", "metrics", "stream", "model", "requests", "duration", "sizes", "running", "_lazy")

    def __init__(self, m: PickerMetrics, labels: tuple[str, str, str, str], stream: bool) -> None:
        self.labels = labels
        self.metrics = m
        self.stream = stream
        self.model = labels[0]
        self.requests = m.requests.labels(*labels)
        self.duration = m.duration.labels(*labels)
        self.sizes = m.request_sizes.labels(*labels)
        self.running = m.running.labels(*labels)
        self._lazy: dict[str, Any] = {}

    def child(self, family: str) -> Any:
        """The child of a response-side family (PickerMetrics.response_families), made when first needed."""
        found = self._lazy.get(family)
        if found is None:
            extra = ("true" if self.stream else "false",) if family == "ttft" else ()
            found = self._lazy[family] = self.metrics.response_families[family].labels(*self.labels, *extra)
        return found


class PickerMetrics:
    """The picker's own series, under the reference picker's current `llm_d_epp_*` names and labels, each also
    emitted under its deprecated GIE name (picker.metric_twins) so existing dashboards keep working."""

    def __init__(self, pool_name: str = "default", registry: CollectorRegistry | None = None,
                 models: Iterable[str] = (), namespace: str = "", stream_metrics: bool = False,
                 deprecated_names: bool = True) -> None:
        self.registry = registry or CollectorRegistry()
        self.pool_name = pool_name
        self.namespace = namespace
        self.models = ModelLabels(models)
        self.fairness = FirstSeenLabels()
        self._series: dict[tuple[str, str, str, str, bool], _RequestSeries] = {}
        # (target model, address) -> its success counter and the counter's labels
        self._attempts: dict[tuple[str, str], tuple[Any, tuple[str, ...]]] = {}
        self.endpoints: list[Endpoint] = []  # the pool as of the last refresh (the in-flight series read it)
        self._plugin_sample = 0
        r = self.registry
        L = REQUEST_LABELS
        self.requests = Counter("llm_d_epp_request", "Requests routed or refused, by model and priority.", L,
                                registry=r)
        self.errors = Counter("llm_d_epp_request_error", "Requests refused by the picker, by error code.",
                              [*L, "error_code"], registry=r)
        self.duration = Histogram("llm_d_epp_request_duration_seconds",
                                  "Request duration from headers to end of response, seen by the picker.",
                                  L, buckets=_LATENCY_BUCKETS, registry=r)
        self.request_sizes = Histogram("llm_d_epp_request_size_bytes", "Request body sizes in bytes.",
                                       L, buckets=_SIZE_BUCKETS, registry=r)
        self.response_sizes = Histogram("llm_d_epp_response_size_bytes",
                                        "Response body sizes in bytes (when Envoy shows the picker response bodies).",
                                        L, buckets=_SIZE_BUCKETS, registry=r)
        self.input_tokens = Histogram("llm_d_epp_request_input_tokens", "Prompt tokens reported in usage.",
                                      L, buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("llm_d_epp_request_output_tokens", "Completion tokens reported in usage.",
                                       L, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_cached_tokens = Histogram("llm_d_epp_request_cached_tokens",
                                               "Prompt tokens served from the pod's prefix cache "
                                               "(usage.prompt_tokens_details.cached_tokens).",
                                               L, buckets=_TOKEN_BUCKETS, registry=r)
        self.running = Gauge("llm_d_epp_request_running", "Requests routed and not finished.", L, registry=r)
        self.ntpot = Histogram("llm_d_epp_request_ntpot_seconds",
                               "Request duration per output token (usage.completion_tokens).",
                               L, buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.ttft = Histogram("llm_d_epp_request_ttft_seconds",
                              "Time from the request to the first response body chunk (when Envoy shows the picker "
                              "response bodies).", [*L, "streaming"], buckets=_LATENCY_BUCKETS, registry=r)
        self.streaming_tpot = Histogram("llm_d_epp_request_streaming_tpot_seconds",
                                        "Streamed responses: time from the first to the last chunk per further "
                                        "output token.", L, buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.streaming_itl = Histogram("llm_d_epp_request_streaming_itl_seconds",
                                       "Streamed responses: time between response body chunks.",
                                       L, buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.scheduler_duration = Histogram("llm_d_epp_scheduler_e2e_duration_seconds",
                                            "Time to schedule one request (filters, scorers, pick).",
                                            buckets=_SCHEDULER_BUCKETS, registry=r)
        self.scheduler_attempts = Counter("llm_d_epp_scheduler_attempts",
                                          "Scheduling attempts by outcome and the endpoint chosen.",
                                          ["status", "target_model_name", "endpoint_name", "namespace", "port"],
                                          registry=r)
        self.plugin_duration = Histogram("llm_d_epp_plugin_duration_seconds",
                                         "Time one plugin took for one request (one request in "
                                         f"{PLUGIN_TIMING_EVERY} is timed).",
                                         ["extension_point", "plugin_type", "plugin_name"],
                                         buckets=_SCHEDULER_BUCKETS, registry=r)
        self.request_processing = Histogram("llm_d_epp_request_processing_duration_seconds",
                                            "Picker time from a complete request to its decision: parsing, admission "
                                            "(including a wait for capacity) and scheduling.",
                                            buckets=_SCHEDULER_BUCKETS, registry=r)
        self.response_processing = Histogram("llm_d_epp_response_processing_duration_seconds",
                                             "Picker time handling one response's body chunks.",
                                             buckets=_SCHEDULER_BUCKETS, registry=r)
        self.info = Gauge("llm_d_epp_info", "The picker's build: always 1.", ["commit", "build_ref"], registry=r)
        self.info.labels("", f"picker-{__version__}").set(1)
        self.rewrites = Counter("llm_d_epp_model_rewrite_decisions",
                                "Requests whose model was rewritten (x-gateway-model-name-rewrite).",
                                ["model_rewrite_name", "model_name", "target_model"], registry=r)
        self.poll_errors = Counter("llm_d_epp_datalayer_poll_errors", "Failed scrapes of the pods' metrics.",
                                   ["source_type"], registry=r)
        self.extract_errors = Counter("llm_d_epp_datalayer_extract_errors",
                                      "Pod metrics pages that could not be read.", ["source_type", "extractor_type"],
                                      registry=r)
        self.poll_errors.labels("metrics-data-source")  # both at 0 from the start: failures show as a rate
        self.extract_errors.labels("metrics-data-source", "core-metrics-extractor")
        pool = ["name"]
        self.avg_kv = Gauge("llm_d_epp_average_kv_cache_utilization", "Mean KV-cache utilisation of ready pods.",
                            pool, registry=r)
        self.avg_queue = Gauge("llm_d_epp_average_queue_size", "Mean waiting requests of ready pods.", pool,
                               registry=r)
        self.avg_running = Gauge("llm_d_epp_average_running_requests", "Mean running requests of ready pods.", pool,
                                 registry=r)
        self.std_kv = Gauge("llm_d_epp_std_dev_kv_cache_utilization", "Spread of the ready pods' KV-cache use.", pool,
                            registry=r)
        self.std_queue = Gauge("llm_d_epp_std_dev_queue_size", "Spread of the ready pods' waiting requests.", pool,
                               registry=r)
        self.std_running = Gauge("llm_d_epp_std_dev_running_requests", "Spread of the ready pods' running requests.",
                                 pool, registry=r)
        self.ready_pods = Gauge("llm_d_epp_ready_endpoints", "Pods the picker may route to.", pool, registry=r)
        self.pod_queue = Gauge("llm_d_epp_per_endpoint_queue_size", "Waiting requests per pod.",
                               ["name", "model_server_endpoint"], registry=r)
        self.in_flight = Gauge("picker_endpoint_in_flight_requests", "Requests the picker routed that have not finished.",
                               ["name", "model_server_pod"], registry=r)
        self.pod_state = Gauge("picker_endpoint_state", "1 for the pod's state: ready (fresh metrics), degraded (routed on "
                               "the picker's own view: its metrics cannot be read) or unready (unreachable, not routed).",
                               ["name", "model_server_pod", "state"], registry=r)
        indexer = ["plugin_name", "plugin_type"]
        self.index_size = Gauge("llm_d_epp_prefix_indexer_size", "Entries in the prefix index.", indexer, registry=r)
        self.index_size_value = self.index_size.labels("prefix-cache-scorer", "prefix-cache-scorer")
        self.chars_per_token = Gauge("picker_prefix_chars_per_token",
                                     "Characters per token of the traffic, learned from the pods' "
                                     "vllm:request_prompt_tokens (prefixCache.charsPerToken until they report it): "
                                     "sizes each pod's part of the prefix index.", registry=r)
        self.index_hit_ratio = Histogram("llm_d_epp_prefix_indexer_hit_ratio",
                                         "Share of a request's prefix blocks the chosen pod already holds (index view).",
                                         indexer, buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                         registry=r)
        self.index_hit_bytes = Histogram("llm_d_epp_prefix_indexer_hit_bytes",
                                         "Prompt characters of the prefix the chosen pod already holds (index view).",
                                         indexer, buckets=_SIZE_BUCKETS, registry=r)
        self._hit_ratio = self.index_hit_ratio.labels("prefix-cache-scorer", "prefix-cache-scorer")
        self._hit_bytes = self.index_hit_bytes.labels("prefix-cache-scorer", "prefix-cache-scorer")
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
        self.prefix_expected = Counter("picker_prefix_expected_tokens",
                                       "Prompt tokens the picker expected the pod to have cached, of the requests "
                                       "whose response reported its cached tokens.", ["name", "model_server_pod"],
                                       registry=r)
        self.prefix_reported = Counter("picker_prefix_reported_tokens",
                                       "Cached prompt tokens the pod reported (usage.prompt_tokens_details) for the "
                                       "same requests: against the expected ones, whether to trust the index.",
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
        self.streams: StreamSeries | None = StreamSeries(r) if stream_metrics else None
        self.flow: FlowSeries | None = None  # with flow control (watch_flow)
        # the request series observed only when the response shows them: made per label set on first use
        self.response_families: dict[str, Histogram] = {
            "response_sizes": self.response_sizes, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "request_cached_tokens": self.request_cached_tokens,
            "ntpot": self.ntpot, "ttft": self.ttft, "streaming_tpot": self.streaming_tpot,
            "streaming_itl": self.streaming_itl}
        r.register(_InFlightCollector(self))
        self.deprecated_names = deprecated_names  # also emit each series under its deprecated GIE name
        self.twins: list[Twin] = []  # every deprecated name declared for these series (emitted or not)
        self.add_twins(self._twins())

    def add_twins(self, twins: Iterable[Twin]) -> None:
        """Declare deprecated names of series in this registry; emitted unless --metrics-deprecated-names=false."""
        declared = tuple(twins)
        self.twins.extend(declared)
        if self.deprecated_names:
            self.registry.register(TwinCollector(declared))

    def _twins(self) -> list[Twin]:
        """The deprecated names the reference still emits for these series, with the labels they had."""
        models, with_priority = ("model_name", "target_model_name"), ("model_name", "target_model_name", "priority")
        pod = {"model_server_endpoint": "model_server_pod", "endpoint_name": "pod_name"}
        return [
            Twin("inference_objective_request", self.requests, with_priority),
            Twin("inference_objective_request_error", self.errors, (*models, "error_code")),
            Twin("inference_objective_request_duration_seconds", self.duration, models),
            Twin("inference_objective_request_sizes", self.request_sizes, models),
            Twin("inference_objective_response_sizes", self.response_sizes, models),
            Twin("inference_objective_input_tokens", self.input_tokens, models),
            Twin("inference_objective_output_tokens", self.output_tokens, models),
            Twin("inference_objective_prompt_cached_tokens", self.request_cached_tokens, models),
            Twin("inference_objective_running_requests", self.running, ("model_name",)),
            Twin("inference_objective_normalized_time_per_output_token_seconds", self.ntpot, models),
            Twin("inference_objective_request_ttft_seconds", self.ttft, models),
            Twin("inference_objective_request_tpot_seconds", self.streaming_tpot, models),
            Twin("inference_pool_average_kv_cache_utilization", self.avg_kv, ("name",)),
            Twin("inference_pool_average_queue_size", self.avg_queue, ("name",)),
            Twin("inference_pool_average_running_requests", self.avg_running, ("name",)),
            Twin("inference_pool_ready_pods", self.ready_pods, ("name",)),
            Twin("inference_pool_per_pod_queue_size", self.pod_queue, ("name", "model_server_endpoint"), pod),
            Twin("inference_extension_scheduler_e2e_duration_seconds", self.scheduler_duration, ()),
            Twin("inference_extension_scheduler_attempts", self.scheduler_attempts,
                 ("status", "target_model_name", "endpoint_name", "namespace", "port"), pod),
            Twin("inference_extension_plugin_duration_seconds", self.plugin_duration,
                 ("extension_point", "plugin_type", "plugin_name")),
            Twin("inference_extension_info", self.info, ("commit", "build_ref")),
            Twin("inference_extension_model_rewrite_decisions", self.rewrites,
                 ("model_rewrite_name", "model_name", "target_model")),
            Twin("inference_extension_prefix_indexer_size", self.index_size, ()),
            Twin("inference_extension_prefix_indexer_hit_ratio", self.index_hit_ratio, ()),
            Twin("inference_extension_prefix_indexer_hit_bytes", self.index_hit_bytes, ()),
            Twin("llm_d_inference_scheduler_datalayer_poll_errors", self.poll_errors, ("source_type",)),
            Twin("llm_d_inference_scheduler_datalayer_extract_errors", self.extract_errors,
                 ("source_type", "extractor_type")),
        ]

    def _request_series(self, request: InferenceRequest) -> _RequestSeries:
        """The request's series: model names bounded by `models`, its fairness id bounded too, its priority."""
        model = self.models.label(request.model)
        target = self.models.label(request.target_model) if request.target_model else model
        key = (model, target, self.fairness.label(request.fairness_id or ""), str(request.priority), request.stream)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _RequestSeries(self, key[:4], request.stream)  # type: ignore[arg-type]
        return series

    def observe_routed(self, request: InferenceRequest, seconds: float, matched_blocks: int, blocks: int,
                       endpoint: Endpoint | None = None, block_chars: int = 0) -> None:
        self.scheduler_duration.observe(seconds)
        series = self._request_series(request)
        series.requests.inc()
        series.sizes.observe(request.body_bytes)
        series.running.inc()
        if blocks:
            self._hit_ratio.observe(matched_blocks / blocks)
            self._hit_bytes.observe(matched_blocks * block_chars)
        if endpoint is not None:
            self._attempt(self.models.label(request.target_model or request.model), endpoint).inc()
        if request.target_model:
            self.rewrites.labels(request.rewrite_rule or "header", self.models.label(request.model),
                                 self.models.label(request.target_model)).inc()

    def observe_refused(self, request: InferenceRequest, code: str, scheduling: bool = False) -> None:
        """A refusal; `scheduling`: the scheduler found no endpoint for it (a failed scheduling attempt)."""
        series = self._request_series(request)
        series.requests.inc()
        model = series.model
        target = self.models.label(request.target_model) if request.target_model else model
        self.errors.labels(model, target, series.labels[2], str(request.priority), code).inc()
        if scheduling:
            self.scheduler_attempts.labels("failure", target, "", self.namespace, "").inc()

    def _attempt(self, target: str, endpoint: Endpoint) -> Any:
        """The successful-attempt counter of (target model, endpoint), remembered so forget_pod can drop it."""
        key = (target, endpoint.address)
        found = self._attempts.get(key)
        if found is None:
            labels = ("success", target, endpoint.name, self.namespace, str(endpoint.port))
            found = self._attempts[key] = (self.scheduler_attempts.labels(*labels), labels)
        return found[0]

    def observe_processing(self, seconds: float) -> None:
        self.request_processing.observe(seconds)

    def observe_finished(self, request: InferenceRequest, seconds: float, usage: Usage | None,
                         response: ResponseTrace | None = None) -> None:
        """A request's duration, and what the response showed when Envoy sent its body: usage, timing, size."""
        series = self._request_series(request)
        series.duration.observe(seconds)
        series.running.dec()
        child = series.child
        if usage is not None:
            child("input_tokens").observe(usage.prompt_tokens)
            child("output_tokens").observe(usage.completion_tokens)
            child("request_cached_tokens").observe(usage.cached_tokens)
            self.prompt_tokens.labels(series.model).inc(usage.prompt_tokens)
            self.cached_tokens.labels(series.model).inc(usage.cached_tokens)
            if usage.completion_tokens > 0:
                child("ntpot").observe(seconds / usage.completion_tokens)
        if response is None or response.chunks == 0:
            return
        child("response_sizes").observe(response.bytes)
        child("ttft").observe(response.first_chunk_at - response.started_at)
        self.response_processing.observe(response.handling_s)
        if request.stream and usage is not None and usage.completion_tokens > 1:
            child("streaming_tpot").observe(
                (response.last_chunk_at - response.first_chunk_at) / (usage.completion_tokens - 1))

    def itl_observer(self, request: InferenceRequest) -> Callable[[float], None] | None:
        """Where a streamed response's chunk gaps go (its streaming ITL series); None for an unstreamed one."""
        return self._request_series(request).child("streaming_itl").observe if request.stream else None

    def plugin_timing_due(self) -> bool:
        """PluginTimer: time this request's plugins? One request in PLUGIN_TIMING_EVERY is."""
        self._plugin_sample = (self._plugin_sample + 1) % PLUGIN_TIMING_EVERY
        return self._plugin_sample == 0

    def observe_plugin(self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float) -> None:
        """PluginTimer: one plugin's time for one (sampled) request."""
        self.plugin_duration.labels(extension_point, plugin_type, plugin_name).observe(seconds)

    def observe_prefix_hit(self, endpoint: Endpoint, expected_tokens: int, reported_tokens: int) -> None:
        """What the index expected a pod to have cached for a request, and what the pod said it had."""
        self.prefix_expected.labels(self.pool_name, endpoint.name).inc(expected_tokens)
        self.prefix_reported.labels(self.pool_name, endpoint.name).inc(reported_tokens)

    def observe_prediction(self, endpoint: Endpoint, predicted_s: float, observed_s: float) -> None:
        """PredictionObserver: one pod's predicted and measured mean TTFT over a scrape interval."""
        self.ttft_predicted.labels(self.pool_name, endpoint.name).set(predicted_s)
        self.ttft_observed.labels(self.pool_name, endpoint.name).set(observed_s)
        if observed_s > 0:
            self.ttft_prediction_ratio.labels(self.pool_name).observe(predicted_s / observed_s)

    def observe_scrape(self, endpoint: Endpoint, ok: bool, unreadable: bool = False) -> None:
        """One scrape of a pod's metrics: failed to fetch (`ok` False), or fetched but not readable."""
        self.scrapes.labels(self.pool_name, endpoint.name, "ok" if ok else "error").inc()
        if not ok:
            self.poll_errors.labels("metrics-data-source").inc()
            if unreadable:
                self.extract_errors.labels("metrics-data-source", "core-metrics-extractor").inc()

    def observe_pool(self, endpoints: Iterable[Endpoint]) -> None:
        """Refresh pool gauges from the latest endpoint state (called after each scrape round)."""
        endpoints = list(endpoints)
        self.endpoints = endpoints
        self.models.learn(endpoints)
        ready = [e for e in endpoints if e.healthy]
        name = self.pool_name
        self.ready_pods.labels(name).set(len(ready))
        if ready:
            for mean, spread, values in (
                    (self.avg_kv, self.std_kv, [e.metrics.kv_usage for e in ready]),
                    (self.avg_queue, self.std_queue, [e.metrics.waiting for e in ready]),
                    (self.avg_running, self.std_running, [e.metrics.running for e in ready])):
                mean.labels(name).set(statistics.fmean(values))
                spread.labels(name).set(statistics.pstdev(values))
        queries = sum(e.metrics.prefix_queries for e in ready)
        hits = sum(e.metrics.prefix_hits for e in ready)
        self.pool_prefix_hit_ratio.labels(name).set(hits / queries if queries else 0.0)
        for e in ready:
            self.pod_queue.labels(name, e.name).set(e.metrics.waiting)
            self.in_flight.labels(name, e.name).set(e.in_flight)
        for e in endpoints:
            for state in EndpointState:
                self.pod_state.labels(name, e.name, state.value).set(1.0 if e.state is state else 0.0)

    def watch_flow(self, controller: FlowController) -> None:
        """Export flow control's series (as the reference does once its flow control is on): outcomes and waits
        per request, and, read at scrape time, the queues, the pool's level and the bands' use."""
        self.flow = FlowSeries(self.registry, controller, self)

    def observe_flow(self, request: InferenceRequest, outcome: str, waited_s: float) -> None:
        """FlowObserver: what happened to a request in flow control and how long it waited."""
        if self.flow is not None:
            self.flow.observe(request, outcome, waited_s)

    def observe_dispatch_cycle(self, seconds: float) -> None:
        if self.flow is not None:
            self.flow.cycle.observe(seconds)

    def observe_enqueue(self, request: InferenceRequest, outcome: str, seconds: float) -> None:
        if self.flow is not None:
            _, _, fairness = self.labels_of(request)
            self.flow.enqueue.labels(fairness, str(request.priority), outcome).observe(seconds)

    def labels_of(self, request: InferenceRequest) -> tuple[str, str, str]:
        """model_name, target_model_name, fairness_id of a request, every one bounded."""
        model = self.models.label(request.model)
        return model, self.models.label(request.target_model) if request.target_model else model, \
            self.fairness.label(request.fairness_id or "")

    def watch_index_sync(self, stats: SyncStats) -> None:
        """Export a shared index's replication counters, read at scrape time."""
        self.registry.register(_IndexSyncCollector(stats))

    def watch_kv_events(self, stats: SubscriberStats, index: PreciseIndex, clock: Callable[[], float]) -> None:
        """Export the KV-event subscriber's counters and each pod's precise view, read at scrape time."""
        self.registry.register(_KVEventsCollector(stats, index, clock))

    def watch_kv_relay(self, stats: RelayStats) -> None:
        """Export the KV-event relay's counters (bind mode with a shared index), read at scrape time."""
        self.registry.register(_KVRelayCollector(stats))

    def forget_pod(self, endpoint: Endpoint) -> None:
        for gauge in (self.pod_queue, self.in_flight, self.ttft_predicted, self.ttft_observed):
            with contextlib.suppress(KeyError):
                gauge.remove(self.pool_name, endpoint.name)
        for counter in (self.prefix_expected, self.prefix_reported):
            with contextlib.suppress(KeyError):
                counter.remove(self.pool_name, endpoint.name)
        for state in EndpointState:
            with contextlib.suppress(KeyError):
                self.pod_state.remove(self.pool_name, endpoint.name, state.value)
        for result in ("ok", "error"):  # a departed pod's series go with it (pod churn must not grow /metrics)
            with contextlib.suppress(KeyError):
                self.scrapes.remove(self.pool_name, endpoint.name, result)
        for key in [k for k in self._attempts if k[1] == endpoint.address]:
            self.scheduler_attempts.remove(*self._attempts.pop(key)[1])


class StreamSeries:
    """ext_proc streams (`--enable-grpc-stream-metrics`, as the reference picker's flag): open now, how long each
    lasted, and the gRPC status each ended with."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.open = Gauge("llm_d_epp_extproc_streams_inflight", "ext_proc streams open now.", registry=r)
        self.duration = Histogram("llm_d_epp_extproc_stream_duration_seconds", "How long each ext_proc stream lasted.",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.ended = Counter("llm_d_epp_extproc_streams", "ext_proc streams ended, by gRPC status.", ["code"],
                             registry=r)


class FlowSeries(Collector):
    """Flow control under the reference's names: each request's outcome and wait, each dispatch cycle's time, and
    at scrape time the queue per flow, the pool's level and each band's use of its bounds."""

    def __init__(self, r: CollectorRegistry, controller: FlowController, metrics: PickerMetrics) -> None:
        self.controller = controller
        self.metrics = metrics
        pool = metrics.pool_name
        self.pool = pool
        self.requests = Counter("llm_d_epp_flow_control_requests", "Requests through flow control, by outcome.",
                                ["outcome", "priority", "inference_pool"], registry=r)
        self.queue_duration = Histogram("llm_d_epp_flow_control_request_queue_duration_seconds",
                                        "Time a request spent in flow control, by outcome.",
                                        ["fairness_id", "priority", "outcome", "inference_pool", "model_name",
                                         "target_model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.cycle = Histogram("llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
                               "Time of one dispatch cycle (letting waiters through as room frees).",
                               buckets=_SCHEDULER_BUCKETS, registry=r)
        self.enqueue = Histogram("llm_d_epp_flow_control_request_enqueue_duration_seconds",
                                 "Time to queue a request, by outcome.", ["fairness_id", "priority", "outcome"],
                                 buckets=_SCHEDULER_BUCKETS, registry=r)
        r.register(self)
        metrics.add_twins([
            Twin("inference_extension_flow_control_request_queue_duration_seconds", self.queue_duration,
                 ("fairness_id", "priority", "outcome", "inference_pool", "model_name", "target_model_name")),
            Twin("inference_extension_flow_control_dispatch_cycle_duration_seconds", self.cycle, ()),
            Twin("inference_extension_flow_control_request_enqueue_duration_seconds", self.enqueue,
                 ("fairness_id", "priority", "outcome")),
            *(Twin(f"inference_extension_flow_control_{name}", self, FLOW_LABELS, family=f"llm_d_epp_flow_control_{name}")
              for name in ("queue_size", "queue_bytes")),
            Twin("inference_extension_flow_control_pool_saturation", self, ("inference_pool", "stage"),
                 family="llm_d_epp_flow_control_pool_saturation"),
        ])

    def observe(self, request: InferenceRequest, outcome: str, waited_s: float) -> None:
        model, target, fairness = self.metrics.labels_of(request)
        priority = str(request.priority)
        self.requests.labels(outcome, priority, self.pool).inc()
        self.queue_duration.labels(fairness, priority, outcome, self.pool, model, target).observe(waited_s)

    def collect(self) -> Iterator[Metric]:
        sizes = GaugeMetricFamily("llm_d_epp_flow_control_queue_size", "Requests waiting in flow control.",
                                  labels=list(FLOW_LABELS))
        volume = GaugeMetricFamily("llm_d_epp_flow_control_queue_bytes", "Body bytes of the requests waiting.",
                                   labels=list(FLOW_LABELS))
        counts: dict[tuple[str, str, str, str, str], list[int]] = {}
        for request in self.controller.waiting():
            model, target, fairness = self.metrics.labels_of(request)
            key = (fairness, str(request.priority), self.pool, model, target)
            entry = counts.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += request.body_bytes
        for key, (n, size) in counts.items():
            sizes.add_metric(list(key), n)
            volume.add_metric(list(key), size)
        yield sizes
        yield volume
        now = self.controller.clock()
        level = self.controller.level(now)
        saturation = GaugeMetricFamily("llm_d_epp_flow_control_pool_saturation",
                                       "The pool's level flow control gates on (1 = full; no roles here: decode is "
                                       "the whole pool).", labels=["inference_pool", "stage"])
        for stage in ("decode", "effective"):
            saturation.add_metric([self.pool, stage], level)
        yield saturation
        settings = self.controller.settings
        requests = GaugeMetricFamily("llm_d_epp_flow_control_capacity_utilization_requests",
                                     "Share of a band's request bound in use.", labels=["priority", "inference_pool"])
        tokens = GaugeMetricFamily("llm_d_epp_flow_control_capacity_utilization_bytes",
                                   "Share of a band's bound in use (prompt tokens, the bound flow control keeps).",
                                   labels=["priority", "inference_pool"])
        for priority, (n, prompt_tokens, _) in sorted(self.controller.queues.band_usage().items()):
            requests.add_metric([str(priority), self.pool], n / settings.max_requests_per_band)
            tokens.add_metric([str(priority), self.pool], prompt_tokens / settings.max_tokens_per_band)
        yield requests
        yield tokens
        stale = GaugeMetricFamily("llm_d_epp_flow_control_stale_endpoints",
                                  "Pods whose metrics are missing or stale (counted as full).", labels=["detector"])
        stale.add_metric(["utilization-detector"], sum(
            1 for e in self.controller.pool()
            if e.metrics.updated_at < 0 or e.metrics_overdue(now) > self.controller.thresholds.stale))
        yield stale


class _InFlightCollector(Collector):
    """The reference's in-flight load series, read from the pool at scrape time: requests and estimated prompt
    tokens this picker has in flight on each pod (priority and fairness id empty: counts are kept per pod)."""

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        labels = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]
        requests = GaugeMetricFamily("llm_d_epp_inflight_requests", "Requests this picker has in flight per pod.",
                                     labels=labels)
        tokens = GaugeMetricFamily("llm_d_epp_inflight_tokens",
                                   "Estimated prompt tokens this picker has in flight per pod.", labels=labels)
        for e in self.metrics.endpoints:
            values = [e.name, self.metrics.namespace, "inflight-load-producer", NO_FAIRNESS_ID, ""]  # kept per pod
            requests.add_metric(values, e.in_flight)
            tokens.add_metric(values, e.in_flight_tokens)
        yield requests
        yield tokens


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


class _KVEventsCollector(Collector):
    def __init__(self, stats: SubscriberStats, index: PreciseIndex, clock: Callable[[], float]) -> None:
        self.stats, self.index, self.clock = stats, index, clock

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        batches = CounterMetricFamily("picker_kv_events_batches", "KV-event messages applied to a pod's precise "
                                      "view (replayed ones included).", labels=["model_server_endpoint"])
        for address, n in sorted(s.by_pod.items()):
            batches.add_metric([address], n)
        yield batches
        problems = CounterMetricFamily("picker_kv_events_problems", "KV-event messages out of the ordinary: gaps "
                                       "in a pod's sequence, messages replayed to fill them, views reset, "
                                       "duplicates, malformed messages, topics naming no pod of the pool.",
                                       labels=["kind"])
        for kind in ("gaps", "replayed", "resets", "duplicates", "malformed", "unknown_topic"):
            problems.add_metric([kind], getattr(s, kind))
        yield problems
        blocks = GaugeMetricFamily("picker_precise_blocks", "Blocks a pod's cache holds as its KV events tell.",
                                   labels=["model_server_endpoint"])
        fresh = GaugeMetricFamily("picker_precise_fresh", "1 while a pod's precise view is trusted (its events "
                                  "flow and account for its work), else 0.", labels=["model_server_endpoint"])
        now = self.clock()
        for address, cache in sorted(self.index.pods.items()):
            blocks.add_metric([address], len(cache.keys))
            fresh.add_metric([address], 1.0 if self.index.fresh(address, now) else 0.0)
        yield blocks
        yield fresh


class _KVRelayCollector(Collector):
    def __init__(self, stats: RelayStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        relayed = CounterMetricFamily("picker_kv_events_relayed", "KV-event messages shared with the other replicas "
                                      "through Redis: sent (heard by this replica's socket), received (another's), "
                                      "dropped (queued while Redis was away, past the bound).", labels=["direction"])
        for direction in ("sent", "received", "dropped"):
            relayed.add_metric([direction], getattr(self.stats, direction))
        yield relayed
        yield CounterMetricFamily("picker_kv_events_relay_errors", "Failed reads and writes of the KV-event relay's "
                                  "Redis stream (each retried).", value=self.stats.errors)


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
