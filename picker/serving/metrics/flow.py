"""Flow control's series under the reference's names (flowcontrol.controller.FlowObserver): each request's outcome
and wait, each dispatch cycle's time, and at scrape time the queue per flow, the pool's level and each band's use."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from picker.core.metric_twins import Twin
from picker.core.requests import InferenceRequest
from picker.flowcontrol.controller import FlowController
from picker.serving.metrics.labels import LATENCY_BUCKETS, SCHEDULER_BUCKETS, RequestLabels

FLOW_LABELS = ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")


class FlowSeries(Collector):
    """Flow control under the reference's names: each request's outcome and wait, each dispatch cycle's time, and
    at scrape time the queue per flow, the pool's level and each band's use of its bounds."""

    def __init__(self, r: CollectorRegistry, controller: FlowController, labels: RequestLabels, pool: str,
                 add_twins: Callable[[Iterable[Twin]], None]) -> None:
        self.controller = controller
        self.labels = labels
        self.pool = pool
        self.requests = Counter("llm_d_epp_flow_control_requests", "Requests through flow control, by outcome.",
                                ["outcome", "priority", "inference_pool"], registry=r)
        self.queue_duration = Histogram("llm_d_epp_flow_control_request_queue_duration_seconds",
                                        "Time a request spent in flow control, by outcome.",
                                        ["fairness_id", "priority", "outcome", "inference_pool", "model_name",
                                         "target_model_name"], buckets=LATENCY_BUCKETS, registry=r)
        self.cycle = Histogram("llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
                               "Time of one dispatch cycle (letting waiters through as room frees).",
                               buckets=SCHEDULER_BUCKETS, registry=r)
        self.enqueue = Histogram("llm_d_epp_flow_control_request_enqueue_duration_seconds",
                                 "Time to queue a request, by outcome.", ["fairness_id", "priority", "outcome"],
                                 buckets=SCHEDULER_BUCKETS, registry=r)
        self.charged = Counter("picker_flow_control_tokens_charged",
                               "Tokens each flow was charged as its requests were let through (fairness: tokens; "
                               "prompt plus weighed output, the turns go to the flow charged least).",
                               ["fairness_id", "priority", "inference_pool"], registry=r)
        r.register(self)
        add_twins([
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

    def observe_flow(self, request: InferenceRequest, outcome: str, waited_s: float) -> None:
        """FlowObserver: what happened to a request in flow control and how long it waited."""
        model, target, fairness = self.labels.of(request)
        priority = str(request.priority)
        self.requests.labels(outcome, priority, self.pool).inc()
        self.queue_duration.labels(fairness, priority, outcome, self.pool, model, target).observe(waited_s)

    def observe_dispatch_cycle(self, seconds: float) -> None:
        self.cycle.observe(seconds)

    def observe_enqueue(self, request: InferenceRequest, outcome: str, seconds: float) -> None:
        _, _, fairness = self.labels.of(request)
        self.enqueue.labels(fairness, str(request.priority), outcome).observe(seconds)

    def observe_charge(self, request: InferenceRequest, tokens: float) -> None:
        _, _, fairness = self.labels.of(request)
        self.charged.labels(fairness, str(request.priority), self.pool).inc(tokens)

    def collect(self) -> Iterator[Metric]:
        sizes = GaugeMetricFamily("llm_d_epp_flow_control_queue_size", "Requests waiting in flow control.",
                                  labels=list(FLOW_LABELS))
        volume = GaugeMetricFamily("llm_d_epp_flow_control_queue_bytes", "Body bytes of the requests waiting.",
                                   labels=list(FLOW_LABELS))
        counts: dict[tuple[str, str, str, str, str], list[int]] = {}
        for request in self.controller.waiting():
            model, target, fairness = self.labels.of(request)
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


