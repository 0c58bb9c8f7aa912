"""The fleet's own events in fast mode, apart from the requests': scrapes, shared-load syncs, pod restarts, a pod
leaving and joining, load samples, and the run's totals. A part of the replay (`_FastRun` in fast.py), which holds
the state these read and write (declared here)."""

from __future__ import annotations

import copy
import math
from typing import Any

from picker.endpoints.scraper import Cadence
from picker.endpoints.state import Endpoint
from picker.prefix.precise import PreciseIndex
from picker.routing.director import Director
from picker_lab.bench.fast_config import DirectorInput, FastConfig
from picker_lab.bench.oracle import InfiniteCacheOracle
from picker_lab.bench.results import RunResult
from picker_lab.bench.trace import Trace
from picker_lab.sim.engine import Engine

# Event kinds; ties at one time go in this order
_DELIVER, _PLACE, _ARRIVE, _INTAKE, _STEP, _SCRAPE, _SAMPLE, _RESTART, _EXPIRE, _POOL, _LOAD_SYNC = range(11)


class FleetEvents:
    trace: Trace
    cfg: FastConfig
    res: RunResult
    engines: list[Engine]
    endpoints: list[Endpoint]
    replica_endpoints: list[list[Endpoint]]
    directors: list[Director]
    precise: PreciseIndex | None
    oracle: InfiniteCacheOracle
    cadence: Cadence
    inputs: list[DirectorInput] | None
    scrapers: int
    scrapes: list[int]
    served: list[int]
    busy: list[float]
    api_busy_until: list[float]
    prefill_tokens: list[float]
    prefill_seconds: list[float]
    prefill_count: list[int]
    ttft_seconds: list[float]
    ttft_count: list[int]
    outstanding: int
    last_event: float

    def push(self, t: float, kind: int, payload: Any) -> None:
        raise NotImplementedError

    def note(self, replica: int, entry: DirectorInput) -> None:
        raise NotImplementedError

    def scrape(self, k: int, now: float) -> None:
        """What the picker's metrics scraper would have read of pod `k` at `now`; its next scrape on the cadence
        (read from the first replica's view: every replica reads the same values)."""
        eng = self.engines[k]
        waiting, running, kv_usage = eng.num_waiting, eng.num_running, eng.kv_usage()
        for endpoints in self.replica_endpoints:
            m = endpoints[k].metrics
            m.waiting = waiting
            m.running = running
            m.kv_usage = kv_usage
            m.prefill_tokens = self.prefill_tokens[k]
            m.prefill_seconds = self.prefill_seconds[k]
            m.prefill_count = self.prefill_count[k]
            m.ttft_seconds = self.ttft_seconds[k]
            m.ttft_count = self.ttft_count[k]
            m.updated_at = now
        interval = self.cadence.interval(self.endpoints[k], ok=True)
        if self.inputs is not None:
            self.note(0, DirectorInput("scraped", now, pod=k, metrics=copy.copy(self.endpoints[k].metrics),
                                       interval=interval))
        for endpoints, director in zip(self.replica_endpoints, self.directors, strict=True):
            endpoints[k].scrape_interval = interval
            director.gate.pod_refreshed(endpoints[k])
        self.scrapes[k] += self.scrapers
        if self.cfg.scrape_cost > 0:
            self.api_busy_until[k] = max(now, self.api_busy_until[k]) + self.cfg.scrape_cost * self.scrapers
        if self.outstanding > 0:
            self.push(now + interval, _SCRAPE, k)

    def sync_load(self, now: float) -> None:
        """Every replica reads the others' in-flight counts as they are now (each publishes and reads once per
        interval: a count is at most one interval old, as with picker serve's shared load)."""
        views = self.replica_endpoints
        for k in range(self.cfg.pods):
            requests = sum(view[k].in_flight for view in views)
            tokens = sum(view[k].in_flight_tokens for view in views)
            for view in views:
                e = view[k]
                e.set_peer_load(requests - e.in_flight, tokens - e.in_flight_tokens)
        for director in self.directors:
            director.gate.load_synced(len(views) - 1)
        if self.outstanding > 0:
            self.push(now + self.cfg.load_sync_interval, _LOAD_SYNC, 0)

    def restart(self, n: int, now: float) -> None:
        """Pod n % pods comes back with an empty cache, too fast for a failed scrape to tell the picker (requests
        in flight run on: a simplification). Its publisher says AllBlocksCleared."""
        k = n % self.cfg.pods
        kv = self.engines[k].kv
        kv.wipe()
        if self.precise is not None:
            self.precise.apply(self.endpoints[k].address, kv.drain_events(), now)
        if self.outstanding > 0:
            self.push(now + self.cfg.restart_every, _RESTART, n + 1)

    def pool_change(self, join: bool, now: float) -> None:
        """The last pod leaves every replica's pool (its requests run on) or comes back with an empty cache."""
        k = self.cfg.pods - 1
        if join:
            kv = self.engines[k].kv
            kv.wipe()
            if self.precise is not None:
                self.precise.apply(self.endpoints[k].address, kv.drain_events(), now)
        self.note(0, DirectorInput("joined" if join else "left", now, pod=k))
        for endpoints, director in zip(self.replica_endpoints, self.directors, strict=True):
            director.pool.set_endpoints(endpoints if join else endpoints[:k])

    def sample(self, now: float) -> None:
        if self.outstanding <= 0:
            return
        self.res.load_times.append(now)
        self.res.load_per_pod.append([e.num_running + e.num_waiting for e in self.engines])
        if self.outstanding > 0:
            self.push(now + self.cfg.sample_interval, _SAMPLE, 0)

    def finish_result(self, wall: float) -> RunResult:
        res = self.res
        res.pod_served = self.served
        res.pod_busy_s = self.busy
        for eng in self.engines:
            s = eng.stats
            res.prefix_queries += s.prefix_cache_queries
            res.prefix_hits += s.prefix_cache_hits
            res.prompt_tokens_total += s.prompt_tokens
            res.prompt_tokens_cached += s.prompt_tokens_cached
            res.generation_tokens += s.generation_tokens
            res.preemptions += s.num_preemptions
        res.oracle_queries = self.oracle.queries
        res.oracle_hits = self.oracle.hits
        first = min((t for t in res.sent if not math.isnan(t)), default=0.0)
        res.duration_s = self.last_event - first
        res.extra["scrapes_per_pod_per_s"] = max(self.scrapes) / res.duration_s if res.duration_s > 0 else 0.0
        res.wall_s = wall
        return res
