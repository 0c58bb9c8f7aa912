"""The scheduler's series: plugin timings (scheduling.plugins.PluginTimer), predicted against measured TTFT (the
predicted-ttft scorer's PredictionObserver), the prefix index's size and the learned characters per token."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Gauge, Histogram

from picker.core.metric_twins import Twin
from picker.endpoints.state import Endpoint
from picker.serving.metrics.labels import RATIO_BUCKETS, SCHEDULER_BUCKETS
from picker.serving.metrics.requests import PREFIX_SCORER

PLUGIN_TIMING_EVERY = 16  # plugins are timed on one request in this many: timing each would tax the hot path


class SchedulingMetrics:
    def __init__(self, r: CollectorRegistry, pool_name: str) -> None:
        self.pool_name = pool_name
        self._plugin_sample = 0
        self.plugin_duration = Histogram("llm_d_epp_plugin_duration_seconds",
                                         "Time one plugin took for one request (one request in "
                                         f"{PLUGIN_TIMING_EVERY} is timed).",
                                         ["extension_point", "plugin_type", "plugin_name"],
                                         buckets=SCHEDULER_BUCKETS, registry=r)
        self.index_size = Gauge("llm_d_epp_prefix_indexer_size", "Entries in the prefix index.",
                                ["plugin_name", "plugin_type"], registry=r)
        self.index_size_value = self.index_size.labels(*PREFIX_SCORER)
        self.chars_per_token = Gauge("picker_prefix_chars_per_token",
                                     "Characters per token of the traffic, learned from the pods' "
                                     "vllm:request_prompt_tokens (prefixCache.charsPerToken until they report it): "
                                     "sizes each pod's part of the prefix index.", registry=r)
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
                                               ["name"], buckets=RATIO_BUCKETS, registry=r)

    def twins(self) -> list[Twin]:
        return [
            Twin("inference_extension_plugin_duration_seconds", self.plugin_duration,
                 ("extension_point", "plugin_type", "plugin_name")),
            Twin("inference_extension_prefix_indexer_size", self.index_size, ()),
        ]

    def plugin_timing_due(self) -> bool:
        """PluginTimer: time this request's plugins? One request in PLUGIN_TIMING_EVERY is."""
        self._plugin_sample = (self._plugin_sample + 1) % PLUGIN_TIMING_EVERY
        return self._plugin_sample == 0

    def observe_plugin(self, extension_point: str, plugin_type: str, plugin_name: str, seconds: float) -> None:
        """PluginTimer: one plugin's time for one (sampled) request."""
        self.plugin_duration.labels(extension_point, plugin_type, plugin_name).observe(seconds)

    def observe_prediction(self, endpoint: Endpoint, predicted_s: float, observed_s: float) -> None:
        """PredictionObserver: one pod's predicted and measured mean TTFT over a scrape interval."""
        self.ttft_predicted.labels(self.pool_name, endpoint.name).set(predicted_s)
        self.ttft_observed.labels(self.pool_name, endpoint.name).set(observed_s)
        if observed_s > 0:
            self.ttft_prediction_ratio.labels(self.pool_name).observe(predicted_s / observed_s)

    def forget_pod(self, endpoint: Endpoint) -> None:
        for gauge in (self.ttft_predicted, self.ttft_observed):
            with contextlib.suppress(KeyError):
                gauge.remove(self.pool_name, endpoint.name)
