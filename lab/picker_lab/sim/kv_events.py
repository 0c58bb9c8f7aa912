"""vLLM KV-cache events as the simulator sends them: the msgpack wire encoding and a ZMQ publisher (the event
records are the picker's own, `picker.kvevents.events`, which also decodes them).

Wire format (vLLM 0.32, checked against tests/data/vllm-kv-events/, captured from vLLM): one ZMQ message per engine step with
three frames `[topic, seq (uint64 big-endian), msgpack([ts, [event, ...], dp_rank])]`; each event is a map whose
first key is "type", with the keys in the order vLLM writes them. Hashes are unsigned 64-bit integers.
vLLM *connects* its PUB socket to a concrete tcp endpoint (the consumer binds), so we do the same. A
data-parallel server's engines each publish on their own: rank r on the endpoint's port + r (its replay socket
too), with r in the payload and a sequence of its own (vLLM's `ZmqEventPublisher.offset_endpoint_port`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack

from picker.kvevents.events import BlockRemoved, BlockStored, KVEvent, rank_endpoint

DEFAULT_TOPIC = "kv-events"
REPLAY_END = (-1).to_bytes(8, "big", signed=True)


def pod_topic(host: str, port: int, model: str) -> str:
    """The topic a pod publishes under when the whole pool shares one endpoint (llm-d's `kv@<pod>@<model>`)."""
    return f"kv@{host}:{port}@{model}"


def event_to_wire(event: KVEvent) -> dict[str, Any]:
    """The map vLLM puts on the wire for one event (key order matters to strict decoders)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": list(event.extra_keys),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium,
                "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def encode_payload(events: Sequence[KVEvent], ts: float | None = None, dp_rank: int = 0) -> bytes:
    """msgpack payload `[ts, [event...], dp_rank]` (third ZMQ frame)."""
    stamp = time.time() if ts is None else ts
    return msgpack.packb([float(stamp), [event_to_wire(e) for e in events], dp_rank], use_bin_type=True)


def encode_message(
    events: Sequence[KVEvent], seq: int, topic: str = DEFAULT_TOPIC, ts: float | None = None, dp_rank: int = 0
) -> list[bytes]:
    """The three frames of one KV-event message."""
    return [topic.encode(), seq.to_bytes(8, "big"), encode_payload(events, ts, dp_rank)]


def _retrieve_exception(future: Any) -> None:
    """Mark a send future's exception as seen: a lost event is what vLLM's PUB socket does too."""
    if not future.cancelled():
        future.exception()


class KVEventPublisher:
    """Publishes event batches on a zmq.asyncio PUB socket connected to the consumer's endpoint; with
    `replay_endpoint`, keeps the last `buffer_steps` messages and serves them on a ROUTER socket as vLLM does (a
    request `[start seq]` gets every buffered message from it, then an end marker of sequence -1)."""

    def __init__(self, endpoint: str, topic: str = DEFAULT_TOPIC, replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, bind: bool | None = None, dp_rank: int = 0) -> None:
        """`bind`: None follows vLLM's rule (bind wildcard and ipc endpoints, connect to the rest); True binds a
        concrete address, as `tcp://*:PORT` would on a pod with an IP of its own (a fleet on one host's loopback
        addresses). `dp_rank`: the data-parallel rank publishing, its endpoints offset as vLLM offsets them."""
        import zmq
        import zmq.asyncio

        endpoint = rank_endpoint(endpoint, dp_rank) or endpoint
        replay_endpoint = rank_endpoint(replay_endpoint, dp_rank)
        self.dp_rank = dp_rank
        self.endpoint = endpoint
        self.topic = topic
        self._ctx = zmq.asyncio.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        if bind or (bind is None and ("*" in endpoint or endpoint.startswith("ipc://"))):
            self._socket.bind(endpoint)  # vLLM binds wildcard and ipc endpoints
        else:
            self._socket.connect(endpoint)
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay: Any = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one message without blocking the event loop (a PUB socket drops rather than blocks)."""
        if not events:
            return
        frames = encode_message(events, self._seq, self.topic, dp_rank=self.dp_rank)
        self._buffer.append((self._seq, frames[2]))
        self._seq += 1
        future: Any = self._socket.send_multipart(frames)
        future.add_done_callback(_retrieve_exception)

    async def _serve_replay(self) -> None:
        topic = self.topic.encode()
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM logs and ignores a malformed request
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
            await self._replay.send_multipart([client, b"", b"", REPLAY_END, b""])

    def close(self) -> None:
        """Close the sockets (the shared context stays for other pods)."""
        if self._replay_task is not None:
            self._replay_task.cancel()
        if self._replay is not None:
            self._replay.close(linger=0)
        self._socket.close(linger=0)
