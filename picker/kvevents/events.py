"""vLLM's KV-cache event records and their wire format (vLLM 0.32; tests/data/vllm-kv-events/ holds real ones).

One ZMQ message per engine step, three frames: `[topic, seq (uint64 big-endian), msgpack([ts, [event, ...],
dp_rank])]`. vLLM 0.32 writes each event as a map whose first key is "type"; older releases wrote positional arrays
tagged by their first element (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, ...]`), and both are read. Block hashes are the low 64 bits of vLLM's digests (unsigned; some releases send
bytes): opaque identifiers to us, used only to find a block again when it is removed. A data-parallel server's
engines publish apart: rank r on the configured endpoint offset by r (`rank_endpoint`), replay socket too, with
r as the payload's dp_rank and a sequence of its own, all under the server's one topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

BlockHash = int | bytes
GPU = "GPU"  # vLLM's medium of device memory; offloading tiers name theirs (CPU, STORAGE)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the prefix cache, in chain order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[list[Any] | None]
    medium: str = GPU  # where the blocks are kept: GPU, or an offloading tier (CPU, STORAGE, ...)

    @property
    def placeholder(self) -> bool:
        """A tier's store that names blocks by hash only (vLLM's offloading connector without
        `self_describing_kv_events`): it can only add a tier to blocks already known from their GPU store."""
        return not self.block_size


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted from one medium to make room (vLLM sends one event per evicted block)."""

    block_hashes: list[BlockHash]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One message: a pod's events of one engine step, in order."""

    topic: str
    seq: int
    ts: float
    events: list[KVEvent]
    dp_rank: int


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Where data-parallel rank `rank` publishes (or replays) when its server is told `endpoint`: a tcp port plus
    the rank (port 0 stays 0), an inproc or ipc name with `_dp{rank}` appended; rank 0 and None as given."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return endpoint if not port.isdigit() or int(port) == 0 else f"{head}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class MalformedEvent(ValueError):
    """A message or event that is not vLLM's KV-event format (says what is wrong)."""


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """The three frames of one message; MalformedEvent if they are not a KV-event message."""
    if len(frames) != 3:
        raise MalformedEvent(f"a KV-event message has 3 frames, not {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise MalformedEvent(f"the sequence frame has {len(seq)} bytes, not 8")
    ts, events, dp_rank = decode_payload(payload)
    try:
        name = topic.decode()
    except UnicodeDecodeError:
        raise MalformedEvent("the topic is not UTF-8") from None
    return EventBatch(name, int.from_bytes(seq, "big"), ts, events, dp_rank)


def decode_payload(payload: bytes) -> tuple[float, list[KVEvent], int]:
    """`[ts, [event, ...], dp_rank]` (dp_rank absent in older releases: 0)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedEvent(f"the payload is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(batch[1], list):
        raise MalformedEvent("the payload is not [ts, [event, ...], dp_rank]")
    ts, raw_events = batch[0], batch[1]
    dp_rank = batch[2] if len(batch) == 3 and batch[2] is not None else 0
    if not isinstance(ts, int | float) or not isinstance(dp_rank, int):
        raise MalformedEvent("the payload's ts or dp_rank is not a number")
    return float(ts), [decode_event(e) for e in raw_events], dp_rank


def decode_event(raw: Any) -> KVEvent:
    """One event, tagged map (vLLM 0.32) or positional array (older)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind, fields = raw[0], dict(zip(_POSITIONAL.get(raw[0], ()), raw[1:], strict=False))
    else:
        raise MalformedEvent(f"an event is a map or a tagged array, not {type(raw).__name__}")
    if kind == "BlockStored":
        hashes, tokens, size = fields.get("block_hashes"), fields.get("token_ids"), fields.get("block_size")
        medium = _medium(fields)
        if not _hash_list(hashes) or not isinstance(tokens, list) or not isinstance(size, int) or size < 0:
            raise MalformedEvent("BlockStored needs block_hashes, token_ids and a block_size")
        if not size and (tokens or medium == GPU):
            raise MalformedEvent("BlockStored: a block_size of 0 is an offloading tier's placeholder, without tokens")
        if not all(isinstance(t, int) for t in tokens) or len(tokens) != size * len(hashes):
            raise MalformedEvent(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
        parent = fields.get("parent_block_hash")
        if parent is not None and not isinstance(parent, int | bytes):
            raise MalformedEvent("BlockStored: parent_block_hash is not a hash")
        lora_id, lora_name = fields.get("lora_id"), fields.get("lora_name")
        extra = fields.get("extra_keys")
        return BlockStored(list(hashes), parent, tokens, size, lora_id if isinstance(lora_id, int) else None,
                           lora_name if isinstance(lora_name, str) else None,
                           list(extra) if isinstance(extra, list) else [None] * len(hashes), medium)
    if kind == "BlockRemoved":
        hashes = fields.get("block_hashes")
        if not _hash_list(hashes):
            raise MalformedEvent("BlockRemoved needs block_hashes")
        return BlockRemoved(list(hashes), _medium(fields))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvent(f"unknown event type {kind!r}")


def _medium(fields: dict[str, Any]) -> str:
    """The event's medium, upper-cased (absent or null: device memory, as before vLLM reported tiers)."""
    medium = fields.get("medium")
    if medium is None:
        return GPU
    if not isinstance(medium, str) or not medium:
        raise MalformedEvent("the medium is not a name")
    return medium.upper()


def _hash_list(value: Any) -> TypeGuard[list[BlockHash]]:
    return isinstance(value, list) and all(isinstance(h, int | bytes) for h in value)


# Field order of the positional (array-like) encoding older vLLM releases used.
_POSITIONAL: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
