"""The pool's series: the ready pods' load, each pod's state, queue and our in-flight requests on it, and what our
scrapes of the pods cost them (`picker_model_server_scrapes`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from picker.core.metric_twins import Twin
from picker.endpoints.state import Endpoint, EndpointState
from picker.serving.metrics.labels import ModelLabels

NO_FAIRNESS_ID = ""


class PoolMetrics:
    """Refreshed after each scrape round (`observe_pool`) and on each scrape (`observe_scrape`)."""

    def __init__(self, r: CollectorRegistry, models: ModelLabels, pool_name: str, namespace: str) -> None:
        self.models = models  # learns the pods' model names with each refresh
        self.pool_name = pool_name
        self.namespace = namespace
        self.endpoints: list[Endpoint] = []  # the pool as of the last refresh (the in-flight series read it)
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
        self.scrape_stretch = Gauge("picker_model_server_scrape_stretch", "How much longer the pods' scrape intervals "
                                    "are than their cadence asks, to keep to --max-scrapes-per-second (1: not "
                                    "stretched).", pool, registry=r)
        self.pods = _PodCollector(self)  # each pod's queue, state and in-flight counts, read when /metrics is
        r.register(self.pods)  # scraped: set pod by pod every second, they stalled the loop ~10 ms at 1,000 pods
        self.scrapes = Counter("picker_model_server_scrapes",
                               "/metrics requests this picker made to each model server (what our signals cost "
                               "the pods), by result.", ["name", "model_server_pod", "result"], registry=r)
        self.restarts = Counter("picker_model_server_restarts", "Model servers seen to restart between two scrapes "
                                "(a counter of theirs went down): what the picker knew of their cache was forgotten.",
                                ["name"], registry=r)
        self.pool_prefix_hit_ratio = Gauge("picker_pool_prefix_cache_hit_ratio",
                                           "Prefix-cache hit ratio of the pool from vLLM counters (hits/queries, tokens); "
                                           "a signal for autoscaling.", ["name"], registry=r)

    def twins(self) -> list[Twin]:
        pod = {"model_server_endpoint": "model_server_pod", "endpoint_name": "pod_name"}
        return [
            Twin("inference_pool_average_kv_cache_utilization", self.avg_kv, ("name",)),
            Twin("inference_pool_average_queue_size", self.avg_queue, ("name",)),
            Twin("inference_pool_average_running_requests", self.avg_running, ("name",)),
            Twin("inference_pool_ready_pods", self.ready_pods, ("name",)),
            Twin("inference_pool_per_pod_queue_size", self.pods, ("name", "model_server_endpoint"), pod,
                 family=POD_QUEUE),
            Twin("llm_d_inference_scheduler_datalayer_poll_errors", self.poll_errors, ("source_type",)),
            Twin("llm_d_inference_scheduler_datalayer_extract_errors", self.extract_errors,
                 ("source_type", "extractor_type")),
        ]

    def observe_scrape(self, endpoint: Endpoint, ok: bool, unreadable: bool = False) -> None:
        """One scrape of a pod's metrics: failed to fetch (`ok` False), or fetched but not readable."""
        self.scrapes.labels(self.pool_name, endpoint.name, "ok" if ok else "error").inc()
        if not ok:
            self.poll_errors.labels("metrics-data-source").inc()
            if unreadable:
                self.extract_errors.labels("metrics-data-source", "core-metrics-extractor").inc()

    def observe_restart(self) -> None:
        self.restarts.labels(self.pool_name).inc()

    def observe_pool(self, endpoints: Iterable[Endpoint], scrape_stretch: float = 1.0) -> None:
        """Refresh pool gauges from the latest endpoint state (every second), and how far scraping is stretched."""
        self.scrape_stretch.labels(self.pool_name).set(scrape_stretch)
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
                column = np.array(values, dtype=np.float64)  # statistics' exact sums took ~1 ms at 1,000 pods
                mean.labels(name).set(float(column.mean()))
                spread.labels(name).set(float(column.std()))
        queries = sum(e.metrics.prefix_queries for e in ready)
        hits = sum(e.metrics.prefix_hits for e in ready)
        self.pool_prefix_hit_ratio.labels(name).set(hits / queries if queries else 0.0)

    def forget_pod(self, endpoint: Endpoint) -> None:
        """A departed pod's series go with it (pod churn must not grow /metrics); the per-pod gauges follow the pool."""
        for result in ("ok", "error"):
            with contextlib.suppress(KeyError):
                self.scrapes.remove(self.pool_name, endpoint.name, result)


POD_QUEUE = "llm_d_epp_per_endpoint_queue_size"


class _PodCollector(Collector):
    """Per pod, from the pool as of the last refresh, at scrape time: its waiting queue and our and the fleet's
    in-flight requests (ready pods), its state (every pod), and the reference's in-flight series: requests and
    estimated prompt tokens this picker has in flight on each pod (priority and fairness id empty: counts are kept
    per pod)."""

    def __init__(self, metrics: PoolMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        name, namespace = self.metrics.pool_name, self.metrics.namespace
        queue = GaugeMetricFamily(POD_QUEUE, "Waiting requests per pod.", labels=["name", "model_server_endpoint"])
        own = GaugeMetricFamily("picker_endpoint_in_flight_requests", "Requests the picker routed that have not "
                                "finished.", labels=["name", "model_server_pod"])
        fleet = GaugeMetricFamily("picker_endpoint_fleet_in_flight_requests", "Requests in flight on the pod from "
                                  "every picker replica, as this one admits on them: its own, plus what its peers "
                                  "last reported (--shared-load-interval).", labels=["name", "model_server_pod"])
        state = GaugeMetricFamily("picker_endpoint_state", "1 for the pod's state: ready (fresh metrics), degraded "
                                  "(routed on the picker's own view: its metrics cannot be read) or unready "
                                  "(unreachable, not routed).", labels=["name", "model_server_pod", "state"])
        labels = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]
        requests = GaugeMetricFamily("llm_d_epp_inflight_requests", "Requests this picker has in flight per pod.",
                                     labels=labels)
        tokens = GaugeMetricFamily("llm_d_epp_inflight_tokens",
                                   "Estimated prompt tokens this picker has in flight per pod.", labels=labels)
        for e in self.metrics.endpoints:
            if e.healthy:
                queue.add_metric([name, e.name], e.metrics.waiting)
                own.add_metric([name, e.name], e.in_flight)
                fleet.add_metric([name, e.name], e.fleet_in_flight)
            for s in EndpointState:
                state.add_metric([name, e.name, s.value], 1.0 if e.state is s else 0.0)
            reference = [e.name, namespace, "inflight-load-producer", NO_FAIRNESS_ID, ""]  # kept per pod
            requests.add_metric(reference, e.in_flight)
            tokens.add_metric(reference, e.in_flight_tokens)
        yield from (queue, own, fleet, state, requests, tokens)
