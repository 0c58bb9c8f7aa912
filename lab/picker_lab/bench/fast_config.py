"""Fast mode's set-up: a run's configuration (FastConfig), what a director was given (DirectorInput), the scheduler
and prefix index a strategy gets, and the exact index (every engine's own cache) the precise view is measured
against. picker_lab/bench/fast.py runs them."""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from picker.core.requests import InferenceRequest
from picker.endpoints.scraper import Cadence
from picker.endpoints.state import EndpointMetrics
from picker.prefix.index import PrefixIndex
from picker.prefix.memory import InMemoryPrefixIndex
from picker.prefix.precise import PrecisePrefix
from picker.routing.admission import AdmissionConfig
from picker.scheduling.config import StrategyDeps, build_prefix_index, build_strategy
from picker.scheduling.types import Scheduler
from picker_lab.sim.engine import Engine
from picker_lab.sim.kvcache import block_hashes
from picker_lab.sim.profiles import Profile


@dataclass(frozen=True)
class FastConfig:
    """The simulated fleet and how the picker observes it."""

    profile: Profile
    pods: int
    seed: int = 0
    scrape_interval: float = 0.05  # picker's --refresh-metrics-interval, when `cadence` is None
    cadence: Cadence | None = None  # per-pod adaptive scraping (picker serve's default); None: fixed interval
    scrape_cost: float = 0.0  # seconds one scrape holds a pod's API server (0: scrapes are free)
    # Seconds from a request's arrival to its pod taking it in: the router's own path (an ext_proc router's round
    # trips through Envoy; the real benchmark's "request held"). The decision is made on arrival, as the picker
    # makes it from what it knows then. Not applied to a P/D request's prefill leg.
    path_delay: float = 0.0
    scraping: bool = True  # the router reads the pods' metrics at all (Envoy alone does not)
    sample_interval: float = 1.0  # per-pod load time series
    prefix_caching: bool = True
    admission: bool = True  # run the picker's admission check (the Envoy-only baseline has none)
    replicas: int = 1  # picker replicas behind Envoy, requests dealt round-robin in arrival order
    shared_index: bool = False  # replicas share one prefix index (Redis-shared index with zero replication lag)
    peer_picks: bool = True  # with shared_index: replicas also learn each other's picks (load, stickiness), as serve does
    # Replicas share their in-flight counts per pod (picker.endpoints.shared_load), each reading the others' as of
    # the last sync, every `load_sync_interval` seconds (0: each counts only its own requests).
    load_sync_interval: float = 0.0
    exact_index: bool = False  # prefix matches read from the pods' real caches: the bound of KV-event routing
    precise: bool = False  # the pods' KV events feed a precise view (--kv-events-endpoint, --prefix-mode auto)
    bypass: float = 0.0  # share of requests sent to a random pod around the picker (it never sees them)
    kv_reported: float = 1.0  # the KV cache the pods report (num_gpu_blocks) as a multiple of their real one
    restart_every: float = 0.0  # seconds between pod restarts, one pod at a time in turn, its cache emptied
    leave_rejoin: tuple[float, float] | None = None  # the last pod leaves the pool at the first time, rejoins empty
    admission_config: AdmissionConfig | None = None  # the picker's admission section (None: its defaults)
    record_inputs: bool = False  # keep what the first replica's director was given and decided (`_FastRun.inputs`)
    roles: tuple[str, ...] = ()  # P/D: each pod's llm-d.ai/role label, in pod order (empty: no roles)


@dataclass(frozen=True, slots=True)
class DirectorInput:
    """One thing a replica's director was given or decided, in the order of the replay (`cfg.record_inputs`):
    a request arrived (`request`, as it came), was placed (`outcome`: its destination, or the refusal's status),
    refused at arrival, expired in the queue, or ended; a pod's metrics were scraped (`metrics`, `interval`),
    the last pod left or joined the pool."""

    kind: str
    at: float
    index: int = -1  # the request's index in the trace
    pod: int = -1
    request: InferenceRequest | None = None
    outcome: str = ""
    metrics: EndpointMetrics | None = None
    interval: float = 0.0


def make_scheduler(strategy: str, seed: int, scheduling: Mapping[str, Any] | None = None, *,
                   index: PrefixIndex | None = None, precise: PrecisePrefix | None = None) -> Scheduler:
    """The scheduler `picker serve --strategy` would run (scheduling config only applies to the full picker);
    `index` replaces its own prefix index (strategies without one ignore it); `precise`: KV events correct it."""
    config = scheduling if strategy == "picker" else None
    return build_strategy(strategy, StrategyDeps(config, random.Random(seed), index, precise=precise))


def shared_prefix_index(strategy: str, scheduling: Mapping[str, Any] | None = None) -> InMemoryPrefixIndex:
    """One index for every replica, sized like the one `build_strategy` gives each scheduler. In-process and
    updated at the pick, so it is the Redis/Valkey-shared index (picker/prefix/shared.py) with zero replication
    lag; the real one converges within milliseconds."""
    return build_prefix_index(scheduling if strategy == "picker" else None)


class ExactCacheIndex:
    """Implements `PrefixIndex` from what each simulated pod's KV cache holds at the moment of the decision.

    The upper bound of precise (KV-event) routing: exact token blocks, no replication or event lag, evictions seen
    at once. `prepare()` hands it each request's token ids before the decision; matches are converted from token
    blocks to the scheduler's character blocks. Recording is a no-op: the caches themselves are the truth.
    """

    ttl: float | None = None

    def __init__(self, engines: list[Engine], addresses: list[str]) -> None:
        self.engines = dict(zip(addresses, engines, strict=True))
        self._hashes: list[int] = []
        self._max_blocks = 0
        self._chars_per_block = 1.0  # prompt characters per token block of this request
        self._block_chars = 1

    def prepare(self, token_ids: list[int], prompt_chars: int, block_chars: int) -> None:
        engine = next(iter(self.engines.values()))
        self._hashes = block_hashes(token_ids, engine.block_size)
        self._max_blocks = (len(token_ids) - 1) // engine.block_size
        self._chars_per_block = prompt_chars / max(1, len(token_ids)) * engine.block_size
        self._block_chars = block_chars

    def match(self, keys: Sequence[int], addresses: Collection[str] | None, now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for address, engine in self.engines.items():
            if addresses is not None and address not in addresses:
                continue
            held = len(engine.kv.lookup(self._hashes, self._max_blocks))
            matched = min(len(keys), int(held * self._chars_per_block // self._block_chars))
            if matched:
                out[address] = matched
        return out

    def record(self, keys: Sequence[int], address: str, now: float, *, prompt_chars: int = 0,
               session_id: str = "") -> None:
        return None

    def remove_endpoint(self, address: str) -> None:
        return None

    def size(self) -> int:
        return 0

    def set_capacity(self, address: str, blocks: int) -> None:
        return None

    def has_room(self, address: str) -> bool:
        return self.engines[address].kv.has_room()

    def expire(self, now: float) -> int:
        return 0
