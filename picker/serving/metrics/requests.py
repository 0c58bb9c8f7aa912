"""The request series (routing.observers.RequestObserver): what the director reports of each request, under the
reference picker's `llm_d_epp_request_*`, scheduler and prefix-indexer names."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from picker.core.metric_twins import Twin
from picker.core.requests import InferenceRequest, Usage
from picker.endpoints.state import Endpoint
from picker.routing.observers import ResponseTrace
from picker.scheduling.types import Disaggregation
from picker.serving.metrics.labels import (
    LATENCY_BUCKETS,
    SCHEDULER_BUCKETS,
    SIZE_BUCKETS,
    TOKEN_BUCKETS,
    TOKEN_TIME_BUCKETS,
    RequestLabels,
)

# The reference picker's labels of request series; fairness_id is the flow-control tenant the request names
# (x-llm-d-inference-fairness-id), empty when it names none.
REQUEST_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")
PREFIX_SCORER = ("prefix-cache-scorer", "prefix-cache-scorer")  # the indexer series' plugin name and type


class _RequestSeries:
    """The children of the request series for one label set, looked up once per event instead of per series.
    The response-side ones are made on first use: a series never observed (no response bodies in buffered mode)
    must not put empty histograms on /metrics."""

    __slots__ = ("labels", "metrics", "stream", "model", "requests", "duration", "sizes", "running", "_lazy")

    def __init__(self, m: RequestMetrics, labels: tuple[str, str, str, str], stream: bool) -> None:
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


class RequestMetrics:
    """Counts, sizes and durations of requests, their refusals, the usage and timing their responses showed,
    scheduling attempts per pod, model rewrites, and the index's expected hits against the pods' reported ones."""

    def __init__(self, r: CollectorRegistry, labels: RequestLabels, pool_name: str, namespace: str) -> None:
        self.labels = labels
        self.pool_name = pool_name
        self.namespace = namespace
        self._series: dict[tuple[str, str, str, str, bool], _RequestSeries] = {}
        # (target model, address) -> its success counter and the counter's labels
        self._attempts: dict[tuple[str, str], tuple[Any, tuple[str, ...]]] = {}
        L = REQUEST_LABELS
        self.requests = Counter("llm_d_epp_request", "Requests routed or refused, by model and priority.", L,
                                registry=r)
        self.errors = Counter("llm_d_epp_request_error", "Requests refused by the picker, by error code.",
                              [*L, "error_code"], registry=r)
        self.duration = Histogram("llm_d_epp_request_duration_seconds",
                                  "Request duration from headers to end of response, seen by the picker.",
                                  L, buckets=LATENCY_BUCKETS, registry=r)
        self.request_sizes = Histogram("llm_d_epp_request_size_bytes", "Request body sizes in bytes.",
                                       L, buckets=SIZE_BUCKETS, registry=r)
        self.response_sizes = Histogram("llm_d_epp_response_size_bytes",
                                        "Response body sizes in bytes (when Envoy shows the picker response bodies).",
                                        L, buckets=SIZE_BUCKETS, registry=r)
        self.input_tokens = Histogram("llm_d_epp_request_input_tokens", "Prompt tokens reported in usage.",
                                      L, buckets=TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("llm_d_epp_request_output_tokens", "Completion tokens reported in usage.",
                                       L, buckets=TOKEN_BUCKETS, registry=r)
        self.request_cached_tokens = Histogram("llm_d_epp_request_cached_tokens",
                                               "Prompt tokens served from the pod's prefix cache "
                                               "(usage.prompt_tokens_details.cached_tokens).",
                                               L, buckets=TOKEN_BUCKETS, registry=r)
        self.running = Gauge("llm_d_epp_request_running", "Requests routed and not finished.", L, registry=r)
        self.ntpot = Histogram("llm_d_epp_request_ntpot_seconds",
                               "Request duration per output token (usage.completion_tokens).",
                               L, buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.ttft = Histogram("llm_d_epp_request_ttft_seconds",
                              "Time from the request to the first response body chunk (when Envoy shows the picker "
                              "response bodies).", [*L, "streaming"], buckets=LATENCY_BUCKETS, registry=r)
        self.streaming_tpot = Histogram("llm_d_epp_request_streaming_tpot_seconds",
                                        "Streamed responses: time from the first to the last chunk per further "
                                        "output token.", L, buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.streaming_itl = Histogram("llm_d_epp_request_streaming_itl_seconds",
                                       "Streamed responses: time between response body chunks.",
                                       L, buckets=TOKEN_TIME_BUCKETS, registry=r)
        self.scheduler_duration = Histogram("llm_d_epp_scheduler_e2e_duration_seconds",
                                            "Time to schedule one request (filters, scorers, pick).",
                                            buckets=SCHEDULER_BUCKETS, registry=r)
        self.scheduler_attempts = Counter("llm_d_epp_scheduler_attempts",
                                          "Scheduling attempts by outcome and the endpoint chosen.",
                                          ["status", "target_model_name", "endpoint_name", "namespace", "port"],
                                          registry=r)
        self.request_processing = Histogram("llm_d_epp_request_processing_duration_seconds",
                                            "Picker time from a complete request to its decision: parsing, admission "
                                            "(including a wait for capacity) and scheduling.",
                                            buckets=SCHEDULER_BUCKETS, registry=r)
        self.response_processing = Histogram("llm_d_epp_response_processing_duration_seconds",
                                             "Picker time handling one response's body chunks.",
                                             buckets=SCHEDULER_BUCKETS, registry=r)
        self.rewrites = Counter("llm_d_epp_model_rewrite_decisions",
                                "Requests whose model was rewritten (x-gateway-model-name-rewrite).",
                                ["model_rewrite_name", "model_name", "target_model"], registry=r)
        self.disagg_decisions = Counter("llm_d_epp_disagg_decision",
                                        "Requests a P/D profile handler decided on: decision_type decode-only "
                                        "(prefilled where decoded) or prefill-decode (prefilled on another pod).",
                                        ["plugin_name", "plugin_type", "model_name", "decision_type"], registry=r)
        indexer = ["plugin_name", "plugin_type"]
        self.index_hit_ratio = Histogram("llm_d_epp_prefix_indexer_hit_ratio",
                                         "Share of a request's prefix blocks the chosen pod already holds (index view).",
                                         indexer, buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                         registry=r)
        self.index_hit_bytes = Histogram("llm_d_epp_prefix_indexer_hit_bytes",
                                         "Prompt characters of the prefix the chosen pod already holds (index view).",
                                         indexer, buckets=SIZE_BUCKETS, registry=r)
        self._hit_ratio = self.index_hit_ratio.labels(*PREFIX_SCORER)
        self._hit_bytes = self.index_hit_bytes.labels(*PREFIX_SCORER)
        self.media_items = Counter("picker_request_media_items", "Images, audio and video in routed requests' prompts.",
                                   ["model_name", "kind"], registry=r)
        self.media_tokens = Counter("picker_request_media_tokens", "Their estimated tokens (the multimodal config).",
                                    ["model_name", "kind"], registry=r)
        self.prompt_tokens = Counter("picker_response_prompt_tokens", "Prompt tokens in responses' usage.",
                                     ["model_name"], registry=r)
        self.cached_tokens = Counter("picker_response_cached_tokens",
                                     "Prompt tokens the model server served from its prefix cache "
                                     "(usage.prompt_tokens_details.cached_tokens).", ["model_name"], registry=r)
        self.prefix_expected = Counter("picker_prefix_expected_tokens",
                                       "Prompt tokens the picker expected the pod to have cached, of the requests "
                                       "whose response reported its cached tokens.", ["name", "model_server_pod"],
                                       registry=r)
        self.prefix_reported = Counter("picker_prefix_reported_tokens",
                                       "Cached prompt tokens the pod reported (usage.prompt_tokens_details) for the "
                                       "same requests: against the expected ones, whether to trust the index.",
                                       ["name", "model_server_pod"], registry=r)
        # the request series observed only when the response shows them: made per label set on first use
        self.response_families: dict[str, Histogram] = {
            "response_sizes": self.response_sizes, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "request_cached_tokens": self.request_cached_tokens,
            "ntpot": self.ntpot, "ttft": self.ttft, "streaming_tpot": self.streaming_tpot,
            "streaming_itl": self.streaming_itl}

    def twins(self) -> list[Twin]:
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
            Twin("inference_extension_scheduler_e2e_duration_seconds", self.scheduler_duration, ()),
            Twin("inference_extension_scheduler_attempts", self.scheduler_attempts,
                 ("status", "target_model_name", "endpoint_name", "namespace", "port"), pod),
            Twin("inference_extension_model_rewrite_decisions", self.rewrites,
                 ("model_rewrite_name", "model_name", "target_model")),
            Twin("inference_extension_prefix_indexer_hit_ratio", self.index_hit_ratio, ()),
            Twin("inference_extension_prefix_indexer_hit_bytes", self.index_hit_bytes, ()),
        ]

    def _request_series(self, request: InferenceRequest) -> _RequestSeries:
        """The request's series: model names bounded by `models`, its fairness id bounded too, its priority."""
        model = self.labels.models.label(request.model)
        target = self.labels.models.label(request.target_model) if request.target_model else model
        key = (model, target, self.labels.fairness.label(request.fairness_id or ""), str(request.priority), request.stream)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _RequestSeries(self, key[:4], request.stream)  # type: ignore[arg-type]
        return series

    def observe_routed(self, request: InferenceRequest, seconds: float, matched_blocks: int, blocks: int,
                       endpoint: Endpoint | None = None, block_chars: int = 0,
                       disaggregation: Disaggregation | None = None) -> None:
        self.scheduler_duration.observe(seconds)
        if disaggregation is not None:
            self.disagg_decisions.labels(disaggregation.plugin_name, disaggregation.plugin_type,
                                         self.labels.models.label(request.target_model or request.model) or "unknown",
                                         disaggregation.decision_type).inc()
        series = self._request_series(request)
        series.requests.inc()
        series.sizes.observe(request.body_bytes)
        series.running.inc()
        if blocks:
            self._hit_ratio.observe(matched_blocks / blocks)
            self._hit_bytes.observe(matched_blocks * block_chars)
        if endpoint is not None:
            self._attempt(self.labels.models.label(request.target_model or request.model), endpoint).inc()
        if request.target_model:
            self.rewrites.labels(request.rewrite_rule or "header", self.labels.models.label(request.model),
                                 self.labels.models.label(request.target_model)).inc()
        for item in request.media:
            model = self.labels.models.label(request.model)
            self.media_items.labels(model, item.kind).inc()
            self.media_tokens.labels(model, item.kind).inc(item.tokens)

    def observe_refused(self, request: InferenceRequest, code: str, scheduling: bool = False) -> None:
        """A refusal; `scheduling`: the scheduler found no endpoint for it (a failed scheduling attempt)."""
        series = self._request_series(request)
        series.requests.inc()
        model = series.model
        target = self.labels.models.label(request.target_model) if request.target_model else model
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

    def observe_prefix_hit(self, endpoint: Endpoint, expected_tokens: int, reported_tokens: int) -> None:
        """What the index expected a pod to have cached for a request, and what the pod said it had."""
        self.prefix_expected.labels(self.pool_name, endpoint.name).inc(expected_tokens)
        self.prefix_reported.labels(self.pool_name, endpoint.name).inc(reported_tokens)

    def forget_pod(self, endpoint: Endpoint) -> None:
        """A departed pod's series go with it (pod churn must not grow /metrics)."""
        for counter in (self.prefix_expected, self.prefix_reported):
            with contextlib.suppress(KeyError):
                counter.remove(self.pool_name, endpoint.name)
        for key in [k for k in self._attempts if k[1] == endpoint.address]:
            self.scheduler_attempts.remove(*self._attempts.pop(key)[1])
