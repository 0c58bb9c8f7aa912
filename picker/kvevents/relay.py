"""KV events shared by picker replicas through Redis or Valkey, for bind mode (`--kv-events-endpoint` with
`--index-backend redis`).

In bind mode the pods' publishers connect to the picker; behind a Service each pod's connection lands on one
replica, so each replica would hear only some pods. Every replica therefore writes the messages its socket
receives, as they came, to one Redis stream per pool, and reads the other replicas' from it into its subscriber,
which puts them through the same ordering as its own (duplicates dropped, a gap filled from the pod's replay
socket or the pod's view reset): every replica holds the whole precise view. Reading starts at the newest entry
(what came before is a gap the ordering handles); the stream keeps `max_entries`. When Redis is away, each
replica keeps its own pods' events and catches up on the others' when it returns; what it wrote meanwhile waits
in a bounded queue.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from picker.core.lifecycle import cancel_all, close_clients
from picker.core.retry import Backoff

log = logging.getLogger(__name__)

_REPLICA, _FRAMES = b"r", b"f"
_READ_BATCH = 200


@dataclass(slots=True)
class RelayStats:
    sent: int = 0  # messages written for the other replicas
    received: int = 0  # messages of the other replicas handed to the subscriber
    dropped: int = 0  # written ones lost to the bounded queue while Redis was away
    errors: int = 0


class EventRelay:
    def __init__(self, redis_url: str, namespace: str, deliver: Callable[[list[bytes]], Awaitable[None]], *,
                 replica_id: str | None = None, max_entries: int = 100_000, max_pending: int = 10_000) -> None:
        """`deliver(frames)` hands another replica's message to this replica's subscriber."""
        self.stream = f"picker:kv-events:{namespace}"
        self.deliver = deliver
        self.replica_id = (replica_id or uuid.uuid4().hex[:12]).encode()
        self.max_entries = max_entries
        self.stats = RelayStats()
        self._writer = aioredis.from_url(redis_url, socket_timeout=2.0)
        self._reader = aioredis.from_url(redis_url, socket_timeout=5.0)
        self._pending: deque[list[bytes]] = deque(maxlen=max_pending)
        self._wake = asyncio.Event()
        self._last_id: bytes | str = "$"
        self._tasks: list[asyncio.Task[None]] = []
        self.following = asyncio.Event()  # set once the reader has its place in the stream (tests wait on it)

    def relay(self, frames: list[bytes]) -> None:
        """A message this replica's socket received: the others get it too."""
        if len(self._pending) == self._pending.maxlen:
            self.stats.dropped += 1
        self._pending.append(frames)
        self._wake.set()

    def start(self) -> None:
        """Begin reading and writing (from the running loop)."""
        self._tasks = [asyncio.create_task(self._read_loop(), name="kv-events-relay-read"),
                       asyncio.create_task(self._write_loop(), name="kv-events-relay-write")]

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        await close_clients(self._writer, self._reader)

    async def _write_loop(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while self._pending:
                    frames = self._pending[0]
                    await self._writer.xadd(self.stream, {_REPLICA: self.replica_id,  # type: ignore[arg-type]
                                                          _FRAMES: msgpack.packb(frames, use_bin_type=True)},
                                            maxlen=self.max_entries, approximate=True)
                    self._pending.popleft()
                    self.stats.sent += 1
                backoff.reset()
            except (RedisError, OSError) as exc:
                self._failed("write", exc)
                await backoff.wait()
                self._wake.set()

    async def _read_loop(self) -> None:
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                if self._last_id == "$":  # the newest entry's id, so nothing between this and the first read is lost
                    newest = await self._reader.xrevrange(self.stream, count=1)
                    self._last_id = (newest[0][0] if newest else None) or b"0-0"
                    self.following.set()
                response = await self._reader.xread({self.stream: self._last_id}, count=_READ_BATCH, block=1000)
                await self._apply(response)
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down or an answer of odd shape: log, count, retry
                self._failed("read", exc)
                await backoff.wait()

    async def _apply(self, response: Any) -> None:
        for _stream, entries in response or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                if fields.get(_REPLICA) == self.replica_id:
                    continue
                frames = msgpack.unpackb(fields[_FRAMES], raw=False)
                if isinstance(frames, list) and all(isinstance(f, bytes) for f in frames):
                    self.stats.received += 1
                    await self.deliver(frames)

    def _failed(self, direction: str, exc: BaseException) -> None:
        self.stats.errors += 1
        if self.stats.errors == 1 or self.stats.errors % 100 == 0:
            log.warning("KV-event relay %s: %s failed (%s: %s; %d errors so far)", self.stream, direction,
                        type(exc).__name__, exc, self.stats.errors)
