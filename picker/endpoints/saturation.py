"""When a pod counts as full: the one definition admission control and the saturation filter share.

A pod's saturation level is max(waiting / queue threshold, KV-cache use / KV threshold), as in GIE's saturation
detector. Metrics we cannot trust (never scraped, or later than the scraper's cadence promised by more than the
stale threshold) put the pod at exactly 1.0: full as far as admission can tell, yet not *past* full, so the
filter does not drop a pod on stale numbers. So while every pod's metrics are stale, sheddable requests are shed
and the others are routed, as the reference picker does. Flow control, which gates every request on the level
counting our own sends, judges a degraded pod (metrics unreadable, pod reachable) by those sends alone: the
requests we sent it beyond those it ran at its last scrape wait there, else a metrics outage would hold every
request in the queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from picker.endpoints.state import Endpoint, EndpointState

FULL = 1.0


@dataclass(frozen=True, slots=True)
class SaturationThresholds:
    queue: float = 5.0  # waiting requests at which a pod counts as full
    kv_cache: float = 0.8  # KV-cache utilisation (0..1) at which a pod counts as full
    stale: float = 0.2  # seconds past the pod's scrape cadence after which its metrics are not trusted

    def __post_init__(self) -> None:
        if self.queue <= 0 or self.kv_cache <= 0:
            raise ValueError("queueThreshold and kvCacheThreshold must be positive")
        if self.stale < 0:
            raise ValueError("staleThreshold must not be negative")


def pod_saturation(endpoint: Endpoint, now: float, thresholds: SaturationThresholds,
                   own_sends: bool = False) -> float:
    """The pod's level: < 1 has room, 1 is full (or unknown), > 1 is past full. With `own_sends`, its waiting
    requests are at least the ones the pickers sent it that it is not running yet (in flight minus running, every
    replica's when they share their load): our sends show before a scrape can."""
    m = endpoint.metrics
    if own_sends and endpoint.state is EndpointState.DEGRADED:
        return max(0.0, endpoint.fleet_in_flight - m.running) / thresholds.queue
    if m.updated_at < 0 or endpoint.metrics_overdue(now) > thresholds.stale:
        return FULL
    waiting = max(m.waiting, endpoint.fleet_in_flight - m.running) if own_sends else m.waiting
    return max(waiting / thresholds.queue, m.kv_usage / thresholds.kv_cache)


def pool_saturation(candidates: Sequence[Endpoint], now: float, thresholds: SaturationThresholds) -> float:
    """Mean pod level over the candidates (0.0 for none: an empty pool is a 503, not saturation)."""
    if not candidates:
        return 0.0
    return sum(pod_saturation(e, now, thresholds) for e in candidates) / len(candidates)


def not_past_full(candidates: list[Endpoint], now: float, thresholds: SaturationThresholds) -> list[Endpoint]:
    """The candidates whose level is at most FULL (`pod_saturation(e) <= 1`), in order. Spelled out for the hot
    path (the saturation filter runs on every decision): no call per pod."""
    queue, kv_cache, stale = thresholds.queue, thresholds.kv_cache, thresholds.stale
    kept = []
    for e in candidates:
        m = e.metrics
        if (m.updated_at < 0 or now - m.updated_at - e.scrape_interval > stale
                or (m.waiting <= queue and m.kv_usage <= kv_cache)):
            kept.append(e)
    return kept


def dispatch_level(candidates: Sequence[Endpoint], now: float, thresholds: SaturationThresholds,
                   pending: int = 0) -> float:
    """The pool's level as flow control gates on it: the mean pod level counting our own sends, plus `pending`
    requests let through and not yet placed, spread over the pool. An empty pool is full."""
    if not candidates:
        return FULL
    total = sum(pod_saturation(e, now, thresholds, own_sends=True) for e in candidates)
    return (total + pending / thresholds.queue) / len(candidates)
