"""vLLM KV-cache events: the event records, their msgpack wire encoding and a ZMQ publisher.

Wire format (vLLM 0.32, checked against tests/data/vllm-kv-events/, captured from vLLM): one ZMQ message per engine step with
three frames `[topic, seq (uint64 big-endian), msgpack([ts, [event, ...], dp_rank])]`; each event is a map whose
first key is "type", with the keys in the order vLLM writes them. Hashes are unsigned 64-bit integers.
vLLM *connects* its PUB socket to a concrete tcp endpoint (the consumer binds), so we do the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

DEFAULT_TOPIC = "kv-events"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the prefix cache, in chain order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[list[Any] | None]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted to make room (vLLM sends one event per evicted block)."""

    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_wire(event: KVEvent, medium: str = "GPU") -> dict[str, Any]:
    """The map vLLM puts on the wire for one event (key order matters to strict decoders)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": medium,
            "lora_name": event.lora_name,
            "extra_keys": list(event.extra_keys),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": medium, "group_idx": 0}
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
    """Publishes event batches on a zmq.asyncio PUB socket connected to the consumer's endpoint."""

    def __init__(self, endpoint: str, topic: str = DEFAULT_TOPIC) -> None:
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self.topic = topic
        self._ctx = zmq.asyncio.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        if "*" in endpoint or endpoint.startswith("ipc://"):
            self._socket.bind(endpoint)  # vLLM binds wildcard and ipc endpoints
        else:
            self._socket.connect(endpoint)
        self._seq = 0

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one message without blocking the event loop (a PUB socket drops rather than blocks)."""
        if not events:
            return
        frames = encode_message(events, self._seq, self.topic)
        self._seq += 1
        future: Any = self._socket.send_multipart(frames)
        future.add_done_callback(_retrieve_exception)

    def close(self) -> None:
        """Close the socket (the shared context stays for other pods)."""
        self._socket.close(linger=0)
