"""Builds the policy objects `picker serve` runs with (scheduler, admission, metrics scraper) from config.

Kept apart from the server so the benchmark builds exactly the same policy without starting servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

from picker.admission import AdmissionConfig, AdmissionController
from picker.config import ServeConfig
from picker.endpoints.pool import EndpointPool
from picker.endpoints.scraper import Cadence, MetricsScraper
from picker.endpoints.shared_scrape import SharedScrapes
from picker.endpoints.state import Endpoint
from picker.observability import PickerMetrics
from picker.prefix.memory import InMemoryPrefixIndex
from picker.prefix.shared import SharedPrefixIndex
from picker.scheduling.config import build_strategy
from picker.scheduling.types import Scheduler


def build_scheduler(config: ServeConfig) -> Scheduler:
    """The `--strategy` (default: the full prefix- and load-aware picker) with the `scheduling` config section."""
    return build_strategy(config.strategy, config=config.scheduling or None, rng=random.Random(config.seed))


def share_index(config: ServeConfig, scheduler: Scheduler) -> SharedPrefixIndex | None:
    """With `--index-backend redis`, put the scheduler's prefix index behind a Redis-shared one (call `start()`)."""
    if config.index_backend != "redis":
        return None
    local = getattr(scheduler, "index", None)
    if not isinstance(local, InMemoryPrefixIndex):
        raise ValueError(f"--index-backend redis needs a strategy with a prefix index, not {config.strategy!r}")
    shared = SharedPrefixIndex(local, config.redis_url, index_namespace(config))
    shared.peer_listener = getattr(scheduler, "on_peer_picked", None)
    scheduler.index = shared  # type: ignore[attr-defined]
    return shared


def build_admission(config: ServeConfig) -> AdmissionController:
    return AdmissionController(AdmissionConfig.from_dict(config.admission))


def scrape_cadence(config: ServeConfig) -> Cadence:
    """A fixed cadence when --refresh-metrics-interval is given (GIE's flag), else the adaptive one. Replicas that
    share scrapes each route only part of a pod's traffic, so they cannot compare it with their own in-flight."""
    if config.refresh_metrics_interval is not None:
        return Cadence.fixed(config.refresh_metrics_interval)
    return Cadence(fast=config.metrics_fast_interval, slow=config.metrics_slow_interval,
                   compare_in_flight=config.index_backend != "redis")


def index_namespace(config: ServeConfig) -> str:
    """Replicas with the same namespace share one prefix index and one set of scrapes."""
    return config.index_namespace or f"{config.pool_namespace or 'default'}/{config.pool_label}"


def shared_scrapes(config: ServeConfig) -> SharedScrapes | None:
    """With `--index-backend redis`, replicas take turns scraping each pod (the pool's scrape load stays that
    of one replica)."""
    if config.index_backend != "redis":
        return None
    return SharedScrapes(config.redis_url, index_namespace(config))


class PoolMonitor:
    """Scrapes every endpoint's vLLM /metrics and turns health changes into pool changes: an endpoint that
    fails `unhealthy_after_failures` polls leaves the ready set and its prefix-index entries are purged."""

    def __init__(self, config: ServeConfig, pool: EndpointPool, scheduler: Scheduler, metrics: PickerMetrics) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.metrics = metrics
        cadence = scrape_cadence(config)
        self.shared = shared_scrapes(config)
        self.scraper = MetricsScraper(pool.all, cadence=cadence, failure_threshold=config.unhealthy_after_failures,
                                      timeout=max(0.2, min(2.0, cadence.fast * 10)),
                                      on_unhealthy=self._unhealthy, on_healthy=self._healthy,
                                      on_scrape=metrics.observe_scrape, shared=self.shared)

    def _unhealthy(self, endpoint: Endpoint) -> None:
        self.pool.refresh()
        self.scheduler.on_endpoint_removed(endpoint)

    def _healthy(self, endpoint: Endpoint) -> None:
        self.pool.refresh()

    async def run(self) -> None:
        await self.scraper.poll_once()  # warm start: metrics before the first request where possible
        await self.scraper.start()
        try:
            index = getattr(self.scheduler, "index", None)  # strategies without a prefix index have none
            while True:
                self.metrics.observe_pool(self.pool.all())
                if index is not None:
                    self.metrics.index_size.set(index.size())
                await asyncio.sleep(1.0)
        finally:
            with contextlib.suppress(Exception):
                await self.scraper.stop()
            if self.shared is not None:
                with contextlib.suppress(Exception):
                    await self.shared.close()


def start_monitor(config: ServeConfig, pool: EndpointPool, scheduler: Scheduler,
                  metrics: PickerMetrics) -> asyncio.Task[None]:
    return asyncio.create_task(PoolMonitor(config, pool, scheduler, metrics).run(), name="pool-monitor")
