"""Scrape results shared by picker replicas through Redis or Valkey, so a pool's scrape load does not grow with
the number of replicas.

Each pod has a lease and a record. The replica holding a pod's lease scrapes it on its cadence and stores what
it parsed (the record: who, when, the cadence it will keep, the metrics or the failure); every other replica
reads the record instead of asking the pod. While a record is fresh (younger than its cadence plus a grace) the
others wait for the next one; when it goes stale (the scraping replica stopped or lost Redis) the first replica
to claim the lease takes over. A replica that cannot reach Redis scrapes the pod itself: a lost Redis costs the
pods the old per-replica load, never visibility. Records carry wall-clock times, so replicas' clocks are assumed
to agree within the grace (NTP does far better); a larger skew costs extra scrapes or a slower takeover, never
wrong metrics.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from picker.endpoints.state import EndpointMetrics

log = logging.getLogger(__name__)

# Take the lease when it is free or already ours; renew it either way. Atomic, so two replicas never both win.
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RECORD_TTL_MIN = 5.0  # seconds a record outlives its cadence, so a reader can tell "stale" from "never"


@dataclass(frozen=True, slots=True)
class SharedSample:
    """One replica's scrape of one pod, as the others read it."""

    replica: str
    at: float  # wall-clock time of the scrape (replicas' monotonic clocks are unrelated)
    interval: float  # seconds until that replica scrapes the pod again
    metrics: EndpointMetrics | None  # None: the scrape failed

    def fresh(self, wall_now: float) -> bool:
        """Still the newest scrape there will be: the next is not yet overdue."""
        return wall_now - self.at <= self.interval + grace(self.interval)


def grace(interval: float) -> float:
    """How late a scrape due every `interval` may be before another replica takes the pod over."""
    return max(0.05, 0.5 * interval)


def _fields(m: EndpointMetrics) -> list[Any]:
    fields: list[Any] = [
        m.waiting, m.running, m.kv_usage, m.block_size, m.num_gpu_blocks, m.prefix_queries, m.prefix_hits,
        m.max_lora, sorted(m.running_loras), sorted(m.waiting_loras), m.prefill_tokens, m.prefill_seconds,
        m.ttft_seconds, m.ttft_count, sorted(m.models), m.prefill_count, m.prompt_tokens, m.prompt_count]  # fmt: skip
    if m.engines:  # a data-parallel server's engines, each as its own fields
        fields.append([[index, *_fields(own)] for index, own in sorted(m.engines.items())])
    return fields


def _encode(sample: SharedSample) -> bytes:
    m = sample.metrics
    return msgpack.packb([sample.replica, sample.at, sample.interval, None if m is None else _fields(m)])


def _metrics(fields: list[Any]) -> EndpointMetrics:
    waiting, running, kv, block, blocks, queries, hits, max_lora, running_loras, waiting_loras = fields[:10]
    # a replica of an earlier release writes 10 fields (no prefill or TTFT counters): read as zeros
    prefill_tokens, prefill_seconds, ttft_seconds, ttft_count = (*fields[10:14], 0.0, 0.0, 0.0, 0.0)[:4]
    models = fields[14] if len(fields) > 14 else ()  # and 14 before the served models were shared
    prefill_count = fields[15] if len(fields) > 15 else 0.0  # and 15 before the prefill count was
    # and 16 before the finished prompts were: unknown (NaN), not 0, which would read as the pod restarting
    prompt_tokens, prompt_count = (fields[16], fields[17]) if len(fields) > 17 else (math.nan, math.nan)
    engines = {int(e[0]): _metrics(e[1:]) for e in fields[18]} if len(fields) > 18 and fields[18] else None
    return EndpointMetrics(
        waiting=float(waiting), running=float(running), kv_usage=float(kv), block_size=block,
        num_gpu_blocks=blocks, prefix_queries=float(queries), prefix_hits=float(hits),
        prefill_tokens=float(prefill_tokens), prefill_seconds=float(prefill_seconds),
        prefill_count=float(prefill_count), prompt_tokens=float(prompt_tokens), prompt_count=float(prompt_count),
        ttft_seconds=float(ttft_seconds), ttft_count=float(ttft_count), max_lora=int(max_lora),
        running_loras=frozenset(running_loras), waiting_loras=frozenset(waiting_loras),
        models=frozenset(models), engines=engines)


def _decode(data: bytes) -> SharedSample:
    replica, at, interval, fields = msgpack.unpackb(data, raw=False)
    metrics = None if fields is None else _metrics(fields)
    return SharedSample(str(replica), float(at), float(interval), metrics)


class SharedScrapes:
    """The lease and record of each pod in Redis; every call fails soft (RedisError -> scrape it yourself)."""

    def __init__(self, redis_url: str, namespace: str, *, replica_id: str | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.wall_clock = wall_clock
        self._prefix = f"picker:{{{namespace}}}:scrape"  # one Redis Cluster slot per pool, like the index
        self._redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
        self._claim = self._redis.register_script(_CLAIM)
        # Redis calls made (picker_shared_scrape_calls), and those that failed
        self.reads = self.claims = self.publishes = self.errors = 0
        self._warned = False

    async def read(self, address: str) -> SharedSample | None:
        """The newest record of `address`; None when there is none, it is garbled or Redis is away."""
        self.reads += 1
        try:
            data = await self._redis.get(f"{self._prefix}:record:{address}")
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return None
        self._warned = False
        if not isinstance(data, bytes):
            return None
        try:
            return _decode(data)
        except (ValueError, TypeError, msgpack.UnpackException):
            log.warning("ignoring a malformed shared scrape record for %s", address)
            return None

    async def claim(self, address: str, hold: float) -> bool:
        """Become (or stay) the replica that scrapes `address` for `hold` seconds. True also when Redis is away:
        then every replica scrapes for itself."""
        self.claims += 1
        try:
            won = await self._claim(keys=[f"{self._prefix}:lease:{address}"],
                                    args=[self.replica_id, max(1, int(hold * 1000))])
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return True
        return bool(won)

    async def publish(self, address: str, metrics: EndpointMetrics | None, interval: float) -> None:
        self.publishes += 1
        sample = SharedSample(self.replica_id, self.wall_clock(), interval, metrics)
        ttl_ms = int(max(_RECORD_TTL_MIN, 3 * interval) * 1000)
        try:
            await self._redis.set(f"{self._prefix}:record:{address}", _encode(sample), px=ttl_ms)
        except (RedisError, OSError) as exc:
            self._failed(exc)

    async def close(self) -> None:
        await self._redis.aclose()

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if not self._warned:
            log.warning("shared scrapes: Redis unreachable (%s); scraping pods directly until it returns",
                        exc.__class__.__name__)
            self._warned = True
