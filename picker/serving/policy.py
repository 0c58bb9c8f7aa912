"""Builds the policy objects `picker serve` runs with (scheduler, admission, metrics scraper) from config.

Kept apart from the server so the benchmark builds exactly the same policy without starting servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from picker.core.replicas import ReplicaView
from picker.endpoints.pool import EndpointPool
from picker.endpoints.scraper import Cadence, MetricsScraper
from picker.endpoints.shared_load import SharedLoad
from picker.endpoints.shared_scrape import SharedScrapes
from picker.endpoints.state import Endpoint
from picker.flowcontrol.controller import FlowController, FlowSettings
from picker.prefix.precise import PreciseIndex, PrecisePrefix
from picker.prefix.shared import SharedPrefixIndex
from picker.routing.admission import AdmissionConfig, BoundedWait, Gate, Priorities
from picker.scheduling.config import INDEXED_STRATEGIES, StrategyDeps, build_prefix_index, build_strategy
from picker.scheduling.plugins import PeerPick
from picker.scheduling.types import Scheduler
from picker.serving.config import ConfigError, ServeConfig
from picker.serving.metrics import PickerMetrics

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Policy:
    """The decision-making objects of one picker, built from its config before anything is served."""

    scheduler: Scheduler
    priorities: Priorities
    shared_index: SharedPrefixIndex | None  # with --index-backend redis: start() it, stop() it
    precise_index: PreciseIndex | None = None  # with --kv-events-endpoint: fed by the KV-event subscriber
    replicas: ReplicaView | None = None  # with a shared index: this replica among the others, kept by the shared load


def build_policy(config: ServeConfig, metrics: PickerMetrics | None = None) -> Policy:
    """The `--strategy` (default: the full prefix- and load-aware picker) with the `scheduling` and `admission`
    sections. With `--index-backend redis` the Redis-shared index is built first and handed to the scheduler,
    and the scheduler then hears of the other replicas' picks through it. `metrics` receives how predictions
    compare with the pods' measurements."""
    shared = shared_index(config)
    key = config.index_key
    if shared is not None and not key.keyed:
        log.warning("the shared prefix index stores unkeyed prefix hashes: whoever reads Redis can confirm a "
                    "guessed prompt; give every replica --index-hash-key-file")
    precise_index = PreciseIndex() if config.kv_events_endpoint or config.kv_events_port else None
    precise = (PrecisePrefix(precise_index, config.prefix_mode)
               if precise_index is not None and config.prefix_mode != "approximate" else None)
    observer = metrics.scheduling if metrics is not None else None  # plugin timings and TTFT predictions
    replicas = ReplicaView() if shared is not None else None
    scheduler = build_strategy(config.strategy, StrategyDeps(
        config.scheduling, random.Random(config.seed), shared, config.admission.thresholds, observer=observer,
        index_key=key, timer=observer, precise=precise, replicas=replicas))
    if shared is not None:
        shared.peer_listener = peer_listener(scheduler)
    return Policy(scheduler, Priorities(config.admission), shared, precise_index, replicas)


def shared_index(config: ServeConfig) -> SharedPrefixIndex | None:
    """With `--index-backend redis`, a Redis-shared index over a local one sized by the scheduling config."""
    if config.index_backend != "redis":
        return None
    if config.strategy not in INDEXED_STRATEGIES:
        raise ConfigError(f"--index-backend redis needs a strategy with a prefix index "
                          f"({', '.join(INDEXED_STRATEGIES)}), not {config.strategy!r}")
    return SharedPrefixIndex(build_prefix_index(config.scheduling), config.redis_url, index_namespace(config))


def build_gate(admission: AdmissionConfig, chars_per_token: int, pool: EndpointPool,
               metrics: PickerMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> Gate[Any]:
    """The admission gate the `admission` section asks for: flow control when `flowControl` is enabled, else the
    saturation detector's bounded wait. The benchmark's fast mode builds the same, on its simulated clock."""
    settings = flow_settings(admission, chars_per_token)
    if settings is None:
        return BoundedWait(admission, clock)
    controller = FlowController(settings, admission.thresholds, pool.ready, clock=clock)
    if metrics is not None:
        controller.observer = metrics.watch_flow(controller)
    return controller


def flow_settings(admission: AdmissionConfig, chars_per_token: int) -> FlowSettings | None:
    """What `admission.flowControl` sets (None: off); the benchmark's fast mode runs the same."""
    fc = admission.flow_control
    if not fc.enabled:
        return None
    # the section's fields are FlowSettings' own (its defaults come from there): handed over by name
    return FlowSettings(**fc.model_dump(exclude={"enabled"}), saturation_limit=admission.saturation_limit,
                        retry_after=admission.retry_after, chars_per_token=chars_per_token)


def scrape_listener(gate: Gate[Any], precise: PreciseIndex | None,
                    ranks_of: Callable[[Endpoint], Sequence[Endpoint]]) -> Callable[[Endpoint], None]:
    """What hears of each refreshed pod: the admission gate (room may have freed), the precise view (whether the
    pod's events account for the work its metrics show: each data-parallel rank's view against its engine's
    counters, `ranks_of`)."""
    if precise is None:
        return gate.pod_refreshed

    def refreshed(endpoint: Endpoint) -> None:
        gate.pod_refreshed(endpoint)
        for target in ranks_of(endpoint) or (endpoint,):
            m = target.metrics
            precise.observe_scrape(target.address, m.prefix_queries - m.prefix_hits, m.updated_at)
    return refreshed


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


def shared_load(config: ServeConfig, pool: EndpointPool, gate: Gate[Any], policy: Policy) -> SharedLoad | None:
    """With `--index-backend redis`, replicas share their in-flight counts (unless --shared-load-interval 0):
    admission hears of each sync, and the other replicas' picks count at once (heard through the shared index)."""
    if policy.shared_index is None or not config.shared_load_interval:
        return None
    load = SharedLoad(config.redis_url, index_namespace(config), pool.targets, find=pool.get,
                      interval=config.shared_load_interval, on_change=gate.load_synced, position=policy.replicas)
    policy.shared_index.peer_listener = peer_listener(policy.scheduler, load, policy.shared_index.clock)
    return load


def peer_listener(scheduler: Scheduler, load: SharedLoad | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Callable[[str, int, str, float, list[int]], None]:
    """What hears another replica's pick through the shared index, which carries its prompt in characters: the
    prompt counted in tokens once, as the director counts ours, for the scheduler and the shared in-flight load."""
    chars_per_token = scheduler.chars_per_token

    def peer_picked(address: str, prompt_chars: int, session_id: str, at: float, keys: list[int]) -> None:
        tokens = prompt_chars / chars_per_token
        scheduler.on_peer_picked(PeerPick(address, tokens, session_id, prompt_chars, keys), at)
        if load is not None and clock() - at <= load.period:  # a pick replayed after an outage is reported already
            load.peer_picked(address, tokens)
    return peer_picked


class PoolMonitor:
    """Scrapes every endpoint's vLLM /metrics; the pool turns failed and recovered scrapes into unready and
    ready events (the director's listener purges an unready pod's prefix-index entries)."""

    def __init__(self, config: ServeConfig, pool: EndpointPool, scheduler: Scheduler, metrics: PickerMetrics,
                 on_metrics: Callable[[Endpoint], None] | None = None) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.metrics = metrics
        cadence = scrape_cadence(config)
        self.shared = shared_scrapes(config)
        if self.shared is not None:
            metrics.watch_shared_scrapes(self.shared)
        self.scraper = MetricsScraper(pool.all, cadence=cadence, failure_threshold=config.unhealthy_after_failures,
                                      timeout=max(0.2, min(2.0, cadence.fast * 10)), health=pool,
                                      on_scrape=metrics.pool.observe_scrape, shared=self.shared,
                                      target=config.metrics_target, on_metrics=on_metrics,
                                      max_rate=config.max_scrapes_per_second, subscribe=pool.subscribe)

    async def run(self) -> None:
        try:
            await self.scraper.poll_once()  # warm start: metrics before the first request where possible
            await self.scraper.start()
            index = self.scheduler.index
            while True:
                self.metrics.pool.observe_pool(self.pool.targets(), self.scraper.stretch)
                self.metrics.scheduling.index_size_value.set(index.size())
                chars_per_token = self.scheduler.learned_chars_per_token
                if chars_per_token is not None:
                    self.metrics.scheduling.chars_per_token.set(chars_per_token)
                await asyncio.sleep(1.0)
        finally:
            with contextlib.suppress(Exception):
                await self.scraper.stop()
            if self.shared is not None:
                with contextlib.suppress(Exception):
                    await self.shared.close()


def start_monitor(config: ServeConfig, pool: EndpointPool, scheduler: Scheduler, metrics: PickerMetrics,
                  on_metrics: Callable[[Endpoint], None] | None = None) -> asyncio.Task[None]:
    """Scrape the pool; `on_metrics` hears of each pod whose metrics were refreshed (flow control's wake-up)."""
    return asyncio.create_task(PoolMonitor(config, pool, scheduler, metrics, on_metrics).run(), name="pool-monitor")
