"""Follows every pod's KV-event stream, in order, into the precise index.

The picker binds one SUB socket (`--kv-events-endpoint tcp://HOST:PORT`) and every pod's vLLM connects its
publisher to it (vLLM connects to a concrete tcp endpoint), each under its own topic: `kv@<pod ip[:port]>@<model>`,
as llm-d names them, which tells the pods apart. A pod's messages carry a sequence number; the subscriber keeps
them in order:
  - the next one: applied;
  - a gap (messages lost, or a picker that started while the pod ran): the missing ones are asked of the pod's
    replay socket (vLLM's `replay_endpoint`, `--kv-events-replay-port`) and applied first; with no replay, or a
    replay that cannot fill it, the pod's view is reset and distrusted until its events rebuild it;
  - sequence 0 again: the pod's publisher restarted (vLLM restarts with an empty cache): its view starts over;
  - an older one: a duplicate, dropped.
A data-parallel server's engines publish apart (rank r on the endpoint's port + r, its own sequence, r in the
payload; vLLM's rule): each rank is a stream of its own, ordered and replayed (from the replay port + r) on its
own, and feeds the view of the rank's target when the pool routes the server's ranks apart (`target_of`), else
the server's one view. In bind mode the subscriber also binds the endpoint's port + r for every rank the pool
knows of (`listen_ranks`); in connect mode it follows each rank's port.
A malformed message is counted and dropped; nothing a pod sends can stop the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from picker.kvevents.events import EventBatch, MalformedEvent, decode_message, rank_endpoint
from picker.prefix.precise import PreciseIndex

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay: no more buffered messages


def topic_host(topic: str) -> str | None:
    """`kv@<host[:port]>@<model>` -> host[:port]; None for any other topic."""
    parts = topic.split("@")
    if len(parts) < 3 or parts[0] != "kv" or not parts[1]:
        return None
    return parts[1]


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0  # applied, replayed ones included
    replayed: int = 0
    gaps: int = 0
    resets: int = 0  # views reset: a gap not filled, a publisher restart
    duplicates: int = 0
    malformed: int = 0
    unknown_topic: int = 0
    by_pod: dict[str, int] = field(default_factory=dict)  # batches applied per pod


class Replayer(Protocol):
    """Where missed messages are asked for."""

    async def fetch(self, host: str, start: int, stop: int, dp_rank: int = 0) -> list[EventBatch] | None:
        """The messages `start`..`stop - 1` of the pod's rank `dp_rank`, in order, or None when they cannot be
        had."""
        ...


class ZmqReplayer:
    """vLLM's replay socket (its `replay_endpoint`, a ROUTER on `port` of every pod, `port + r` for its
    data-parallel rank r): send the first sequence wanted, get every buffered message from it, then an end marker
    of sequence -1."""

    def __init__(self, port: int, timeout: float = 1.0) -> None:
        self.port = port
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context.instance()

    async def fetch(self, host: str, start: int, stop: int, dp_rank: int = 0) -> list[EventBatch] | None:
        hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: dict[int, EventBatch] = {}
        try:
            dealer.connect(f"tcp://{hostname}:{self.port + dp_rank}")
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) == 4 and frames[2] == END_SEQ:
                        break
                    with contextlib.suppress(MalformedEvent):
                        batch = decode_message(frames[1:])
                        if start <= batch.seq < stop:
                            got[batch.seq] = batch
        except (TimeoutError, zmq.ZMQError) as exc:
            log.info("KV events: replay from %s failed (%s)", host, exc or type(exc).__name__)
            return None
        finally:
            dealer.close(linger=0)
        return [got[seq] for seq in sorted(got)]


def _whole_server(address: str, dp_rank: int) -> str:
    return address


class KVEventSubscriber:
    def __init__(self, endpoint: str, index: PreciseIndex, pod_of: Callable[[str], str | None], *,
                 target_of: Callable[[str, int], str] | None = None, replayer: Replayer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`pod_of(host[:port])` names the pool's pod a topic speaks for (its address), None if none;
        `target_of(address, dp_rank)` the view that rank's events feed (default: the pod's own)."""
        self.endpoint = endpoint
        self.index = index
        self.pod_of = pod_of
        self.target_of = target_of or _whole_server
        self.replayer = replayer
        self.clock = clock
        self.next_seq: dict[tuple[str, int], int] = {}  # (pod address, dp rank) -> the sequence number expected next
        self.stats = SubscriberStats()
        self._ctx = zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._listening = 1  # bind mode: ranks whose ports are bound (the endpoint's port + rank)
        self.bound = asyncio.Event()  # set once the socket listens (tests wait on it)
        # connect mode: pod address -> its reader, its socket and how many ranks' ports it is connected to
        self._followed: dict[str, tuple[asyncio.Task[None], zmq.asyncio.Socket, int]] = {}
        # bind mode with replicas: where the messages this socket receives go for the other replicas (relay.py)
        self.relay: Callable[[list[bytes]], None] | None = None

    def _sub_socket(self) -> zmq.asyncio.Socket:
        socket = self._ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        return socket

    def follow(self, address: str, host: str, port: int, ranks: int = 1) -> None:
        """Connect mode: read the pod's own publishers at host:port, and port + r for each of its other `ranks`
        (from the running loop); a pod followed before with fewer ranks gains the ports of the new ones."""
        followed = self._followed.get(address)
        if followed is None:
            socket = self._sub_socket()
            task = asyncio.get_running_loop().create_task(self._follow(address, host, socket),
                                                          name=f"kv-events {address}")
            followed = (task, socket, 0)
        task, socket, connected = followed
        for rank in range(connected, ranks):
            socket.connect(f"tcp://[{host}]:{port + rank}" if ":" in host else f"tcp://{host}:{port + rank}")
        self._followed[address] = (task, socket, max(connected, ranks))

    def unfollow(self, address: str) -> None:
        followed = self._followed.pop(address, None)
        if followed is not None:
            followed[0].cancel()
        self.restart_streams(address)

    def restart_streams(self, address: str) -> None:
        """Forget where every rank's stream of the pod stood: its next messages are taken as gaps (replayed, or its
        views rebuilt from scratch), as when the views they fed were dropped for others (its ranks split apart or
        merged again)."""
        for stream in [k for k in self.next_seq if k[0] == address]:
            del self.next_seq[stream]

    def listen_ranks(self, ranks: int) -> None:
        """Bind mode: also listen where ranks 1..`ranks - 1` of a data-parallel server publish (the endpoint's
        port + rank); a port that cannot be bound is logged, its rank's events not heard."""
        if ranks <= self._listening:
            return
        wanted, self._listening = range(self._listening, ranks), ranks
        if self._socket is not None:
            self._bind_ranks(self._socket, wanted)

    def _bind_ranks(self, socket: zmq.asyncio.Socket, ranks: range) -> None:
        for rank in ranks:
            endpoint = rank_endpoint(self.endpoint, rank) or self.endpoint
            if endpoint == self.endpoint:
                log.warning("KV events: %s has no port to offset: rank %d's events are not heard", endpoint, rank)
                continue
            try:
                socket.bind(endpoint)
            except zmq.ZMQError as exc:
                log.warning("KV events: cannot listen on %s for data-parallel rank %d (%s)", endpoint, rank, exc)
            else:
                log.info("KV events: listening on %s for data-parallel rank %d", endpoint, rank)

    async def _follow(self, address: str, host: str, socket: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    batch = decode_message(frames)
                except MalformedEvent as exc:
                    self._malformed(exc)
                    continue
                await self._in_order(address, host, batch)
        finally:
            socket.close(linger=0)

    async def run(self) -> None:
        """Bind mode: listen on the endpoint for every pod's publisher."""
        socket = self._socket = self._sub_socket()
        socket.bind(self.endpoint)
        self._bind_ranks(socket, range(1, self._listening))
        self.bound.set()
        log.info("KV events: listening on %s", self.endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                await self.receive(frames)
        finally:
            socket.close(linger=0)
            self._socket = None

    async def receive(self, frames: list[bytes]) -> None:
        """One message as it came off the socket; the other replicas get it too (with a relay)."""
        if await self._receive(frames) and self.relay is not None:
            self.relay(frames)

    async def receive_relayed(self, frames: list[bytes]) -> None:
        """One message another replica's socket received."""
        await self._receive(frames)

    async def _receive(self, frames: list[bytes]) -> bool:
        """Apply a message in its pod's order; False when it is malformed or names no pod of the pool."""
        try:
            batch = decode_message(frames)
        except MalformedEvent as exc:
            self._malformed(exc)
            return False
        host = topic_host(batch.topic)
        address = self.pod_of(host) if host is not None else None
        if address is None:
            self.stats.unknown_topic += 1
            return False
        await self._in_order(address, host or "", batch)
        return True

    async def _in_order(self, address: str, host: str, batch: EventBatch) -> None:
        stream = (address, batch.dp_rank)
        view = self.target_of(address, batch.dp_rank)
        expected = self.next_seq.get(stream)
        if expected is None and batch.seq == 0:
            self._apply(stream, view, batch)
        elif batch.seq == 0 and expected is not None and expected > 0:
            log.info("KV events from %s start over (its publisher restarted): its view too", view)
            self.stats.resets += 1
            self.index.pod(view).clear()  # a restarted vLLM starts empty: nothing to distrust
            self._apply(stream, view, batch)
        elif expected is not None and batch.seq < expected:
            self.stats.duplicates += 1
        elif expected is not None and batch.seq == expected:
            self._apply(stream, view, batch)
        else:  # a gap, or the first message we see of a pod that ran before us
            self.stats.gaps += 1
            start = expected if expected is not None else 0
            if not await self._replay(stream, view, host, start, batch.seq):
                log.info("KV events from %s: messages %d..%d missing and not replayed; its view starts over",
                         view, start, batch.seq - 1)
                self.stats.resets += 1
                self.index.reset(view, self.clock())
            self._apply(stream, view, batch)

    def _apply(self, stream: tuple[str, int], view: str, batch: EventBatch) -> None:
        self.index.apply(view, batch.events, self.clock())
        self.next_seq[stream] = batch.seq + 1
        self.stats.batches += 1
        self.stats.by_pod[view] = self.stats.by_pod.get(view, 0) + 1

    async def _replay(self, stream: tuple[str, int], view: str, host: str, start: int, stop: int) -> bool:
        """Messages `start`..`stop - 1` of the stream from its pod's replay socket, applied; True if every one
        came."""
        if self.replayer is None:
            return False
        got = await self.replayer.fetch(host, start, stop, stream[1])
        if got is None or [b.seq for b in got] != list(range(start, stop)):
            return False
        for batch in got:
            self._apply(stream, view, batch)
        self.stats.replayed += len(got)
        return True

    def _malformed(self, exc: Exception) -> None:
        self.stats.malformed += 1
        if self.stats.malformed == 1 or self.stats.malformed % 1000 == 0:
            log.warning("KV events: malformed message dropped (%s; %d so far)", exc, self.stats.malformed)

    async def stop(self) -> None:
        for address in list(self._followed):
            self.unfollow(address)
        with contextlib.suppress(Exception):
            if self._socket is not None:
                self._socket.close(linger=0)
