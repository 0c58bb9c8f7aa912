"""Series read at scrape time from the shared index's replication, the shared load, the shared scrapes, the
KV-event subscriber and relay."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # annotations only: the KV-event modules import zmq, an extra `picker serve` may lack
    from picker.endpoints.shared_load import LoadSyncStats
    from picker.endpoints.shared_scrape import SharedScrapes
    from picker.kvevents.relay import RelayStats
    from picker.kvevents.subscriber import SubscriberStats
    from picker.prefix.precise import PreciseIndex
    from picker.prefix.shared import SyncStats


class IndexSyncCollector(Collector):
    def __init__(self, stats: SyncStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        entries = CounterMetricFamily("picker_prefix_index_sync_entries",
                                      "Shared prefix index entries published to Redis (sent), applied from other "
                                      "replicas (received), dropped while Redis was unreachable, or refused as "
                                      "stale (made before their pod restarted or left, arriving after).",
                                      labels=["direction"])
        for direction, value in (("sent", s.sent), ("received", s.received), ("dropped", s.dropped),
                                 ("stale", s.stale)):
            entries.add_metric([direction], value)
        yield entries
        yield CounterMetricFamily("picker_prefix_index_sync_errors", "Failed Redis calls of the shared prefix index.",
                                  value=s.errors)
        yield GaugeMetricFamily("picker_prefix_index_sync_lag_seconds",
                                "Age of the newest entry from another replica when it was applied.",
                                value=s.lag_seconds)
        yield GaugeMetricFamily("picker_prefix_index_sync_pending",
                                "Entries waiting to be published (they pile up while Redis is unreachable).",
                                value=s.pending)
        yield GaugeMetricFamily("picker_prefix_index_sync_connected", "1 while Redis answers, else 0.",
                                value=1.0 if s.connected else 0.0)


class LoadSyncCollector(Collector):
    def __init__(self, stats: LoadSyncStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        syncs = CounterMetricFamily("picker_shared_load_syncs", "Round trips to Redis sharing the replicas' "
                                    "in-flight counts, by result.", labels=["result"])
        syncs.add_metric(["ok"], s.syncs)
        syncs.add_metric(["error"], s.errors)
        yield syncs
        sent = CounterMetricFamily("picker_shared_load_bytes", "Bytes of in-flight reports written to Redis (sent) "
                                   "and read back (received).", labels=["direction"])
        sent.add_metric(["sent"], s.bytes_sent)
        sent.add_metric(["received"], s.bytes_received)
        yield sent
        yield GaugeMetricFamily("picker_shared_load_peers", "Other replicas whose in-flight counts this one admits on.",
                                value=s.peers)
        yield GaugeMetricFamily("picker_shared_load_connected", "1 while Redis answers the shared load, else 0.",
                                value=1.0 if s.connected else 0.0)


class SharedScrapeCollector(Collector):
    def __init__(self, scrapes: SharedScrapes) -> None:
        self.scrapes = scrapes

    def collect(self) -> Iterator[Metric]:
        s = self.scrapes
        calls = CounterMetricFamily("picker_shared_scrape_calls", "Redis calls of the shared scrapes: records read "
                                    "(another replica's scrape of a pod), leases claimed or renewed, records "
                                    "published (our scrape, for the others).", labels=["call"])
        for call, value in (("read", s.reads), ("claim", s.claims), ("publish", s.publishes)):
            calls.add_metric([call], value)
        yield calls
        yield CounterMetricFamily("picker_shared_scrape_errors", "Failed Redis calls of the shared scrapes (the pod "
                                  "is then scraped directly).", value=s.errors)


class KVEventsCollector(Collector):
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
        tiers = GaugeMetricFamily("picker_precise_medium_blocks", "Blocks a pod holds in each medium (GPU, and the "
                                  "offloading tiers' CPU, STORAGE) as its KV events tell.",
                                  labels=["model_server_endpoint", "medium"])
        now = self.clock()
        for address, cache in sorted(self.index.pods.items()):
            blocks.add_metric([address], len(cache.keys))
            fresh.add_metric([address], 1.0 if self.index.fresh(address, now) else 0.0)
            for medium, count in cache.medium_blocks().items():
                tiers.add_metric([address, medium], count)
        yield blocks
        yield fresh
        yield tiers


class KVRelayCollector(Collector):
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
