"""A prefix index shared by picker replicas through Redis or Valkey (active-active).

Each replica keeps the whole index in memory, so a routing decision never waits on the network, and
publishes what it learns (picks from `record`, departures from `remove_endpoint`) to one Redis stream per
pool; every replica applies the other replicas' entries. The stream is the shared state: entries older than
the index TTL are trimmed by stream ID (XADD MINID), so a replica that starts later replays the last TTL's
worth of picks and joins warm. LRU bounds (each pod's KV-cache size) apply in every replica's view exactly as
for a single replica. When Redis is unreachable each replica keeps routing on its own view, queues what it
learns (bounded), and catches up when the connection returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from picker.core.lifecycle import cancel_all, close_clients
from picker.core.retry import Backoff
from picker.prefix.memory import InMemoryPrefixIndex

log = logging.getLogger(__name__)

# A stream entry is {r: replica id, p: msgpack list of picks}: one entry per flush, so a burst of picks costs one
# XADD and one entry to read back. A pick is [op, address, wall time, packed keys, prompt chars, session id].
_REPLICA, _PICKS = b"r", b"p"
_RECORD, _REMOVE = "r", "x"
_READ_BATCH = 200  # entries per XREAD
_PICKS_PER_ENTRY = 256
_FORGOTTEN_PRUNE_AT = 4096  # pods remembered as forgotten before the old ones are let go
_FORGOTTEN_KEEP_S = 3600.0  # how long a forgetting is kept without an index TTL
_Pick = tuple[str, str, float, bytes, int, str]


@dataclass(slots=True)
class SyncStats:
    """Counters the metrics loop exports (`picker_prefix_index_sync_*`)."""

    sent: int = 0
    received: int = 0
    dropped: int = 0
    stale: int = 0  # picks of another replica refused: made before the pod was last forgotten (it restarted or left)
    pending: int = 0  # picks waiting to be published (Redis away, or between two flushes)
    errors: int = 0
    lag_seconds: float = 0.0  # age of the newest remote entry when it was applied
    following: bool = False  # the last read of the stream worked (and gave an answer of the right shape)
    publishing: bool = True  # no write failed since the last one that worked

    @property
    def connected(self) -> bool:
        """Both directions work: a follower that stopped must show, even while writes still go through."""
        return self.following and self.publishing


class MalformedReply(ValueError):
    """Redis (or something speaking its protocol) answered in a shape the command never has."""


def _server_time(reply: Any) -> float:
    """TIME's answer, (seconds, microseconds), as seconds."""
    if not isinstance(reply, (tuple, list)) or len(reply) != 2:
        raise MalformedReply(f"TIME answered {reply!r:.80}, not (seconds, microseconds)")
    try:
        return int(reply[0]) + int(reply[1]) / 1e6
    except (TypeError, ValueError):
        raise MalformedReply(f"TIME answered {reply!r:.80}, not two integers") from None


def _stream_entries(response: Any) -> Iterator[tuple[bytes, Any]]:
    """(entry id, fields) of XREAD's answer: a list of (stream, entries) in RESP2, a mapping in RESP3."""
    if response is None:
        return
    if isinstance(response, dict):
        streams: Any = response.items()
    elif isinstance(response, list):
        streams = response
    else:
        raise MalformedReply(f"XREAD answered a {type(response).__name__}")
    for stream in streams:
        if not isinstance(stream, (tuple, list)) or len(stream) != 2 or not isinstance(stream[1], list):
            raise MalformedReply(f"XREAD answered {stream!r:.80} for a stream")
        for entry in stream[1]:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], bytes):
                raise MalformedReply(f"XREAD answered {entry!r:.80} for an entry")
            yield entry[0], entry[1]


def stream_name(namespace: str) -> str:
    """One stream per pool; the braces keep every key of a pool in one Redis Cluster slot."""
    return f"picker:{{{namespace}}}:prefix-index"


def encode_keys(keys: Sequence[int]) -> bytes:
    return array("Q", keys).tobytes()


def decode_keys(data: bytes) -> list[int]:
    if len(data) % 8:
        raise ValueError(f"key payload of {len(data)} bytes is not a whole number of uint64")
    keys = array("Q")
    keys.frombytes(data)
    return keys.tolist()


class SharedPrefixIndex:
    """Implements `PrefixIndex`: reads from the local view, publishes and applies changes through Redis.

    `start()` connects and replays the stream; `stop()` flushes what is pending. Not thread-safe: the asyncio
    loop owns it, like the in-memory index it wraps.
    """

    def __init__(
        self,
        local: InMemoryPrefixIndex,
        redis_url: str,
        namespace: str,
        *,
        replica_id: str | None = None,
        flush_interval: float = 0.002,
        max_pending: int = 10_000,  # picks held while Redis is away (each up to 2 KB of keys)
        max_stream_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.local = local
        self.stream = stream_name(namespace)
        self.replica_id = (replica_id or uuid.uuid4().hex[:12]).encode()
        self.flush_interval = flush_interval
        self.max_stream_entries = max_stream_entries
        self.clock = clock
        self.wall_clock = wall_clock
        self.stats = SyncStats()
        self._warned: set[str] = set()  # directions ("follow", "publish") whose failure was logged since it last worked
        # Told of every pick another replica made (address, prompt chars, session id, when, the prompt's keys), so
        # the scheduler's load, stickiness and homes cover the whole fleet's routing, not only this replica's.
        self.peer_listener: Callable[[str, int, str, float, list[int]], None] | None = None
        # from_url validates the URL now, so a typo fails `picker serve` at start-up, not at the first pick.
        self._writer = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
        self._reader = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1.0)
        self._pending: deque[_Pick] = deque()
        self._max_pending = max_pending
        self._wake = asyncio.Event()
        self._last_id = b"0-0"
        self._positioned = False
        self._server_offset = 0.0  # Redis clock - our wall clock, so trimming follows the stream IDs' clock
        self._applied_floor = -float("inf")
        # address -> wall time it was last forgotten (here or by another replica): a pick made before that, arriving
        # late (from a replica that could not publish while Redis was away), would bring back what the pod lost.
        self._forgotten: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # PrefixIndex --------------------------------------------------------------------------------------

    @property
    def ttl(self) -> float | None:
        return self.local.ttl

    def match(self, keys: Sequence[int], addresses: Collection[str] | None, now: float) -> dict[str, int]:
        return self.local.match(keys, addresses, now)

    def record(self, keys: Sequence[int], address: str, now: float, *, prompt_chars: int = 0,
               session_id: str = "") -> None:
        self.local.record(keys, address, now)
        if keys:
            wall = now + self.wall_clock() - self.clock()
            self._publish((_RECORD, address, wall, encode_keys(keys), prompt_chars, session_id))

    def remove_endpoint(self, address: str) -> None:
        self.local.remove_endpoint(address)
        wall = self.wall_clock()
        self._forget(address, wall)
        self._publish((_REMOVE, address, wall, b"", 0, ""))

    def _forget(self, address: str, wall: float) -> None:
        """Remember when `address` was last forgotten; forgettings older than the index TTL are let go (an entry
        recorded before them has expired anyway), so pods that come and go do not grow the map without bound."""
        self._forgotten[address] = max(wall, self._forgotten.get(address, wall))
        if len(self._forgotten) > _FORGOTTEN_PRUNE_AT:
            horizon = self.wall_clock() - (self.local.ttl or _FORGOTTEN_KEEP_S)
            self._forgotten = {a: t for a, t in self._forgotten.items() if t >= horizon}

    def size(self) -> int:
        return self.local.size()

    def set_capacity(self, address: str, blocks: int) -> None:
        # Not shared: every replica reads the pod's num_gpu_blocks from the pod itself.
        self.local.set_capacity(address, blocks)

    def has_room(self, address: str) -> bool:
        return self.local.has_room(address)

    def expire(self, now: float) -> int:
        return self.local.expire(now)

    # Lifecycle ----------------------------------------------------------------------------------------

    async def start(self, catch_up_timeout: float = 5.0) -> None:
        """Replay the last TTL of the shared stream (bounded in time), then follow it and publish."""
        try:
            applied = await asyncio.wait_for(self._catch_up(), catch_up_timeout)
            log.info("shared prefix index %s: replayed %d entries, %d index entries", self.stream, applied,
                     self.local.size())
        except Exception as exc:  # noqa: BLE001 - unreachable, or answers no Redis gives (the client library's own
            self.stats.errors += 1  # parsing raises what it likes): start anyway, the follower retries
            log.warning("shared prefix index %s: Redis not usable at start (%s: %s); routing on the local view "
                        "and retrying", self.stream, type(exc).__name__, exc)
        self._tasks = [asyncio.create_task(self._read_loop(), name="prefix-index-read"),
                       asyncio.create_task(self._write_loop(), name="prefix-index-write")]

    async def stop(self, flush_timeout: float = 1.0) -> None:
        reader = self._tasks[0] if self._tasks else None
        if reader is not None:
            reader.cancel()
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            await asyncio.wait_for(self._flush_all(), flush_timeout)
        await cancel_all(self._tasks)
        self._tasks = []
        await close_clients(self._writer, self._reader)

    # Publishing ---------------------------------------------------------------------------------------

    def _publish(self, pick: _Pick) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()  # Redis has been away a long time: keep the newest knowledge
            self.stats.dropped += 1
        self._pending.append(pick)
        self.stats.pending = len(self._pending)
        self._wake.set()

    async def _write_loop(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_interval)  # let a burst of picks share one round trip
            try:
                await self._flush_all()
                backoff.reset()
            except (RedisError, OSError) as exc:
                self._failed("publish", exc)
                await backoff.wait()
                self._wake.set()

    async def _flush_all(self) -> None:
        while self._pending:
            picks = [self._pending.popleft() for _ in range(min(_PICKS_PER_ENTRY, len(self._pending)))]
            entry = {_REPLICA: self.replica_id, _PICKS: msgpack.packb(picks, use_bin_type=True)}
            try:
                ttl = self.local.ttl
                if ttl is not None:  # the stream is the index: entries older than the TTL are trimmed away
                    minid = f"{max(0, int((self.wall_clock() + self._server_offset - ttl) * 1000))}-0"
                    await self._writer.xadd(self.stream, entry, minid=minid, approximate=True)  # type: ignore[arg-type]
                else:
                    await self._writer.xadd(self.stream, entry, maxlen=self.max_stream_entries,  # type: ignore[arg-type]
                                            approximate=True)
            except BaseException:
                self._pending.extendleft(reversed(picks))  # retried after the backoff, order kept
                raise
            self.stats.sent += len(picks)
            self.stats.pending = len(self._pending)
            self._recovered("publish")

    # Following ----------------------------------------------------------------------------------------

    async def _position(self) -> None:
        """Start reading one TTL back, by the server's clock: stream IDs are the server's milliseconds."""
        self._server_offset = _server_time(await self._reader.time()) - self.wall_clock()
        ttl = self.local.ttl
        if ttl is not None:
            self._last_id = f"{max(0, int((self.wall_clock() + self._server_offset - ttl) * 1000))}-0".encode()
        self._positioned = True

    async def _catch_up(self) -> int:
        if not self._positioned:
            await self._position()
        applied = 0
        while True:
            response = await self._reader.xread({self.stream: self._last_id}, count=_READ_BATCH)
            n = self._apply_response(response)
            applied += n
            self._recovered("follow")
            if n < _READ_BATCH:
                return applied

    async def _read_loop(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                if not self._positioned:
                    await self._catch_up()
                response = await self._reader.xread({self.stream: self._last_id}, count=_READ_BATCH, block=1000)
                self._apply_response(response)
                self._recovered("follow")
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down, an answer of odd shape, a client library bug:
                self._failed("follow", exc)  # the follower must never end; it logs, counts and retries
                await backoff.wait()

    def _apply_response(self, response: Any) -> int:
        """Apply XREAD's answer; returns the entries read. MalformedReply when its shape is wrong (nothing after
        the bad part is applied, and the read is retried from the last good entry)."""
        count = 0
        for entry_id, entry in _stream_entries(response):
            self._last_id = entry_id
            count += 1
            if not isinstance(entry, dict):
                self._malformed(entry_id, MalformedReply(f"fields of a {type(entry).__name__}"))
                continue
            if not entry or entry.get(_REPLICA) == self.replica_id:
                continue
            try:
                picks = msgpack.unpackb(entry[_PICKS], raw=False)
                if not isinstance(picks, list):
                    raise ValueError("the picks are not a list")
            except (KeyError, ValueError, TypeError, msgpack.UnpackException) as exc:
                self._malformed(entry_id, exc)
                continue
            for pick in picks:
                try:
                    self._apply(pick)
                except (ValueError, TypeError, IndexError, KeyError, UnicodeDecodeError) as exc:
                    self._malformed(entry_id, exc)
        return count

    def _apply(self, pick: list[Any]) -> None:
        op, address, wall = pick[0], str(pick[1]), float(pick[2])
        now = self.clock()
        if op == _REMOVE:
            self.local.remove_endpoint(address)
            self._forget(address, wall)
        elif op == _RECORD:
            if wall < self._forgotten.get(address, wall):
                self.stats.stale += 1
                return
            keys = decode_keys(pick[3])
            # Into our clock, never in the future, never older than what we applied before: the local view's
            # LRU order must follow time for its TTL and longest-match invariants.
            at = min(now, max(wall - self.wall_clock() + now, self._applied_floor))
            self._applied_floor = at
            self.local.record(keys, address, at, never_older=True)
            if self.peer_listener is not None:
                self.peer_listener(address, int(pick[4]), str(pick[5]), at, keys)
        else:
            raise ValueError(f"unknown operation {op!r}")
        self.stats.received += 1
        self.stats.lag_seconds = max(0.0, self.wall_clock() - wall)

    def _malformed(self, entry_id: bytes, exc: BaseException) -> None:
        self.stats.errors += 1
        log.warning("shared prefix index %s: skipping a malformed pick in entry %s: %s", self.stream,
                    entry_id.decode(errors="replace"), exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count every failure; log when a direction goes from working to failing (not on every retry)."""
        self.stats.errors += 1
        if what not in self._warned:
            self._warned.add(what)
            log.warning("shared prefix index %s: %s failed (%s: %s); routing on the local view, retrying",
                        self.stream, what, type(exc).__name__, exc)
        if what == "follow":
            self.stats.following = False
        else:
            self.stats.publishing = False

    def _recovered(self, what: str) -> None:
        self._warned.discard(what)
        if what == "follow":
            self.stats.following = True
        else:
            self.stats.publishing = True
