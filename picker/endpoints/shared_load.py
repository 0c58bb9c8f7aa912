"""In-flight load shared by picker replicas through Redis or Valkey, so each admits on the whole fleet's
requests, not only the share Envoy dealt it.

Every `interval` each replica writes its own in-flight requests and prompt tokens per pod (only the pods it has
requests on) into one hash per pool, a field per replica, and reads the hash back: one pipelined round trip, never
one inside a routing decision. It then sets each pod's peer counts to the others' last reports
(`Endpoint.set_peer_load`); a pick another replica makes counts at once in between, heard through the shared
index's stream (`peer_picked`). A report also carries the characters per token its replica has learned, which a
replica that has just started routes on until it has learned its own (`picker.core.replicas`). Flow control's
dispatch level and its running slots read the fleet's count (`Endpoint.fleet_in_flight`), so replicas do not each
fill the room they all see. Routing keeps scoring on our own
counts: on the simulator and on live replicas the fleet's counts, a sync old for the requests that ended, routed no
better and live worse (bench/studies/replicas.md, "Several picker replicas"; docs/decisions.md).

A sync that takes long (thousands of pods, many replicas) makes the next one wait longer, so syncing never takes
more than 5 % of a replica's time. A report older than `stale` seconds, or than three of its writer's periods (its
replica stopped or lost Redis), no longer counts, and is deleted once it is older than a minute; a replica that
stops cleanly deletes its own at once. When Redis cannot be reached for `stale` seconds the peers' counts are
dropped: each replica then counts only its own requests, as without sharing, until Redis answers again. Reports
carry wall-clock times, so the replicas' clocks must agree to well within `stale` (NTP does far better).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from picker.core.replicas import ReplicaView
from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)

_FORGET_AFTER = 60.0  # seconds after which another replica's abandoned report is deleted from the hash
MAX_BUSY = 0.05  # the most of its time a replica spends syncing (round trip, reading and summing the reports)


def sync_period(interval: float, took: float) -> float:
    """Seconds from one sync to the next: `interval`, or longer when a sync took over MAX_BUSY of that."""
    return max(interval, took / MAX_BUSY)


@dataclass(slots=True)
class LoadSyncStats:
    """Counters the metrics loop exports (`picker_shared_load_*`): what sharing costs Redis, and whether it works."""

    syncs: int = 0  # round trips that worked
    errors: int = 0  # round trips that failed
    bytes_sent: int = 0
    bytes_received: int = 0
    peers: int = 0  # other replicas whose reports counted in the last sync
    connected: bool = False  # the last round trip worked


def encode(at: float, period: float, pods: Sequence[Endpoint], chars_per_token: float | None = None) -> bytes:
    """One replica's report: when, the seconds until its next, [address, requests, prompt tokens] of every pod it
    has requests on, and the characters per token it has learned (nil: none yet)."""
    return msgpack.packb([at, period, [[e.address, e.in_flight, e.in_flight_tokens]
                                       for e in pods if e.in_flight or e.in_flight_tokens], chars_per_token])


def decode(data: bytes) -> tuple[float, float, list[tuple[str, int, int]], float | None]:
    """(wall time, period, [(address, requests, tokens)], learned chars per token or None); ValueError when the
    report is not one. A report of a release before the learned figure has three fields."""
    try:
        at, period, pods, *rest = msgpack.unpackb(data, raw=False)
        learned = float(rest[0]) if rest and rest[0] is not None else None
        if learned is not None and not learned > 0:
            raise ValueError(f"characters per token {learned}")
        return float(at), float(period), [(str(a), int(n), int(t)) for a, n, t in pods], learned
    except (TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed load report: {exc}") from None


class SharedLoad:
    """Publishes this replica's in-flight counts and applies the others' to `pool()`; `on_change` hears of every
    applied sync with the number of other replicas counted (admission's `Gate.load_synced`)."""

    def __init__(self, redis_url: str, namespace: str, pool: Callable[[], Sequence[Endpoint]], *,
                 find: Callable[[str], Endpoint | None] | None = None,
                 interval: float, stale: float | None = None, replica_id: str | None = None,
                 wall_clock: Callable[[], float] = time.time, on_change: Callable[[int], None] | None = None,
                 position: ReplicaView | None = None) -> None:
        if interval <= 0:
            raise ValueError("the shared load's interval must be positive")
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.pool = pool
        self.find = find  # a pod by address (the pool's index), for the peers' picks
        self.interval = interval
        self.stale = stale if stale is not None else max(1.0, 10 * interval)
        self.wall_clock = wall_clock
        self.on_change = on_change
        # kept current: this replica's index among those reporting, and the characters per token they learned
        self.position = position
        self.key = f"picker:{{{namespace}}}:load"  # one Redis Cluster slot per pool, like the index
        self.stats = LoadSyncStats()
        self._redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
        self._last_ok = -1.0  # wall time of the last sync that worked
        self._peers_applied = False  # some pod carries peers' counts now
        self.period = interval  # the time between syncs now: `interval`, longer when a sync takes long

    def peer_picked(self, address: str, prompt_tokens: float) -> None:
        """Another replica routed a request to `address` (its pick, heard through the shared index within
        milliseconds): counted at once, until the next sync replaces it with that replica's report."""
        endpoint = self.find(address) if self.find is not None else None
        if endpoint is not None:
            endpoint.peer_started(prompt_tokens)

    async def close(self) -> None:
        """Delete our report, so the others stop counting our requests at once (after `run` was cancelled)."""
        with contextlib.suppress(RedisError, OSError):
            await self._redis.hdel(self.key, self.replica_id)
        await self._redis.aclose()

    async def run(self) -> None:
        """Sync every `interval` until cancelled; never more than `MAX_BUSY` of the time: a sync that takes long
        (thousands of pods, many replicas: every report is read and summed on the event loop) waits longer."""
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.sync_once()
            took = loop.time() - began
            self.period = sync_period(self.interval, took)
            await asyncio.sleep(self.period - took)

    async def sync_once(self) -> bool:
        """Publish ours, read everyone's, apply the others'. False when Redis did not answer."""
        pods = self.pool()
        now = self.wall_clock()
        report = encode(now, self.period, pods,
                        self.position.chars_per_token if self.position is not None else None)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.key, self.replica_id, report)
                pipe.hgetall(self.key)
                _, reports = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc, pods, now)
            return False
        if not isinstance(reports, dict):  # not what HGETALL gives: a broken proxy or server, treated as away
            self._failed(ValueError(f"HGETALL answered {type(reports).__name__}"), pods, now)
            return False
        if not self.stats.connected and self.stats.errors:
            log.info("shared load: Redis answers again; counting the other replicas' requests")
        self.stats.connected = True
        self.stats.syncs += 1
        self.stats.bytes_sent += len(report)
        self._last_ok = now
        self._apply(reports, pods, now)
        return True

    def _apply(self, reports: dict[bytes, bytes], pods: Sequence[Endpoint], now: float) -> None:
        own = self.replica_id.encode()
        requests: dict[str, int] = {}
        tokens: dict[str, int] = {}
        peers = 0
        live: list[str] = []
        learned: list[float] = []
        abandoned = []
        for replica, data in reports.items():
            if replica == own:
                continue
            try:
                self.stats.bytes_received += len(data)
                at, period, counts, chars_per_token = decode(data)
            except (TypeError, ValueError):
                log.warning("ignoring a malformed shared load report from replica %r", replica)
                continue
            if now - at > max(self.stale, 3 * period):  # a replica syncing slowly (a large pool) is not gone
                if now - at > _FORGET_AFTER:
                    abandoned.append(replica)
                continue
            peers += 1
            live.append(replica.decode(errors="replace"))
            if chars_per_token is not None:
                learned.append(chars_per_token)
            for address, n, t in counts:
                requests[address] = requests.get(address, 0) + n
                tokens[address] = tokens.get(address, 0) + t
        for e in pods:
            e.set_peer_load(requests.get(e.address, 0), tokens.get(e.address, 0))
        self.stats.peers = peers
        self._peers_applied = peers > 0
        if self.position is not None:
            self.position.update(self.replica_id, live)
            self.position.heard(learned)
        if abandoned:
            asyncio.get_running_loop().create_task(self._forget(abandoned))
        if self.on_change is not None:
            self.on_change(peers)

    async def _forget(self, replicas: list[bytes]) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._redis.hdel(self.key, *replicas)

    def _failed(self, exc: BaseException, pods: Sequence[Endpoint], now: float) -> None:
        self.stats.errors += 1
        if self.stats.connected or self.stats.errors == 1:
            log.warning("shared load: Redis unreachable or answering garbage (%s); each replica counts only its own "
                        "requests after %gs", exc, self.stale)
        self.stats.connected = False
        if self._peers_applied and now - self._last_ok > self.stale:
            for e in pods:  # the peers' last counts are too old to trust: ours alone, as without sharing
                e.set_peer_load(0, 0)
            self._peers_applied = False
            if self.position is not None:
                self.position.update(self.replica_id, ())
            self.stats.peers = 0
            if self.on_change is not None:
                self.on_change(0)
