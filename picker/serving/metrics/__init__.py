"""Prometheus metrics (the reference picker's names, current and deprecated), one facade per concern: the
requests the director handles (`requests`), the pool and our scrapes (`pool`), the scheduler (`scheduling`), the
ext_proc streams (`streams`), flow control (`flow`), and the watchers read at scrape time. Each facade implements
the observer interface the layer it serves declares. OpenTelemetry tracing of decisions is `tracing`.

One `PickerMetrics` per server, on its own registry, so several pickers can live in one process (tests,
benchmarks) without clashing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

from picker import __version__
from picker.core.metric_twins import Twin, TwinCollector
from picker.endpoints.state import Endpoint
from picker.flowcontrol.controller import FlowController
from picker.serving.metrics.collectors import (
    IndexSyncCollector,
    KVEventsCollector,
    KVRelayCollector,
    LoadSyncCollector,
    SharedScrapeCollector,
)
from picker.serving.metrics.flow import FlowSeries
from picker.serving.metrics.labels import FirstSeenLabels, ModelLabels, RequestLabels
from picker.serving.metrics.pool import PoolMetrics
from picker.serving.metrics.requests import RequestMetrics
from picker.serving.metrics.scheduling import SchedulingMetrics
from picker.serving.metrics.streams import StreamMetrics

if TYPE_CHECKING:  # annotations only: the KV-event modules import zmq, an extra `picker serve` may lack
    from picker.endpoints.shared_load import LoadSyncStats
    from picker.endpoints.shared_scrape import SharedScrapes
    from picker.kvevents.relay import RelayStats
    from picker.kvevents.subscriber import SubscriberStats
    from picker.prefix.precise import PreciseIndex
    from picker.prefix.shared import SyncStats


class PickerMetrics:
    """The picker's own series, under the reference picker's current `llm_d_epp_*` names and labels, each also
    emitted under its deprecated GIE name (core.metric_twins) so existing dashboards keep working."""

    def __init__(self, pool_name: str = "default", registry: CollectorRegistry | None = None,
                 models: Iterable[str] = (), namespace: str = "", stream_metrics: bool = False,
                 deprecated_names: bool = True) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.pool_name = pool_name
        self.labels = RequestLabels(ModelLabels(models), FirstSeenLabels())
        self.info = Gauge("llm_d_epp_info", "The picker's build: always 1.", ["commit", "build_ref"], registry=r)
        self.info.labels("", f"picker-{__version__}").set(1)
        self.requests = RequestMetrics(r, self.labels, pool_name, namespace)
        self.pool = PoolMetrics(r, self.labels.models, pool_name, namespace)
        self.scheduling = SchedulingMetrics(r, pool_name)
        self.streams = StreamMetrics(r, stream_metrics)
        self.flow: FlowSeries | None = None  # with flow control (watch_flow)
        self.deprecated_names = deprecated_names  # also emit each series under its deprecated GIE name
        self.twins: list[Twin] = []  # every deprecated name declared for these series (emitted or not)
        self.add_twins([*self.requests.twins(), *self.pool.twins(), *self.scheduling.twins(),
                        Twin("inference_extension_info", self.info, ("commit", "build_ref"))])

    def add_twins(self, twins: Iterable[Twin]) -> None:
        """Declare deprecated names of series in this registry; emitted unless --metrics-deprecated-names=false."""
        declared = tuple(twins)
        self.twins.extend(declared)
        if self.deprecated_names:
            self.registry.register(TwinCollector(declared))

    def watch_flow(self, controller: FlowController) -> FlowSeries:
        """Export flow control's series (as the reference does once its flow control is on): outcomes and waits
        per request, and, read at scrape time, the queues, the pool's level and the bands' use. The controller's
        observer."""
        self.flow = FlowSeries(self.registry, controller, self.labels, self.pool_name, self.add_twins)
        return self.flow

    def watch_index_sync(self, stats: SyncStats) -> None:
        """Export a shared index's replication counters, read at scrape time."""
        self.registry.register(IndexSyncCollector(stats))

    def watch_load_sync(self, stats: LoadSyncStats) -> None:
        """Export the shared load's counters (what it costs Redis, whether it works), read at scrape time."""
        self.registry.register(LoadSyncCollector(stats))

    def watch_shared_scrapes(self, scrapes: SharedScrapes) -> None:
        """Export what the replicas' turns at scraping each pod cost Redis, read at scrape time."""
        self.registry.register(SharedScrapeCollector(scrapes))

    def watch_kv_events(self, stats: SubscriberStats, index: PreciseIndex, clock: Callable[[], float]) -> None:
        """Export the KV-event subscriber's counters and each pod's precise view, read at scrape time."""
        self.registry.register(KVEventsCollector(stats, index, clock))

    def watch_kv_relay(self, stats: RelayStats) -> None:
        """Export the KV-event relay's counters (bind mode with a shared index), read at scrape time."""
        self.registry.register(KVRelayCollector(stats))

    def forget_pod(self, endpoint: Endpoint) -> None:
        """A departed pod's series go with it, in every facade (pod churn must not grow /metrics)."""
        self.requests.forget_pod(endpoint)
        self.pool.forget_pod(endpoint)
        self.scheduling.forget_pod(endpoint)
