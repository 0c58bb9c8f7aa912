"""KV-event wire format against real vLLM 0.32 captures, and delivery over ZMQ from a running pod."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from picker.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from picker_lab.sim.fleet import SimFleet
from picker_lab.sim.kv_events import encode_message, encode_payload
from picker_lab.sim.kvcache import block_hashes

SAMPLES = Path(__file__).resolve().parent.parent / "data" / "vllm-kv-events"  # captured from a real vLLM 0.32


def sample_events() -> dict[str, dict[str, Any]]:
    """First event of each type across the captured payloads."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(SAMPLES.glob("*.msgpack")):
        payload = msgpack.unpackb(path.read_bytes(), raw=False)
        for event in payload[1]:
            found.setdefault(event["type"], event)
    return found




def test_encoded_events_have_the_captured_keys_order_and_types() -> None:
    real = sample_events()
    ours: dict[str, BlockStored | BlockRemoved | AllBlocksCleared] = {
        "BlockStored": BlockStored([2**64 - 5, 7], None, list(range(256)), 128, 1, "tinylora", [["tinylora"], None]),
        "BlockRemoved": BlockRemoved([2**63 + 1]),
        "AllBlocksCleared": AllBlocksCleared(),
    }
    payload = msgpack.unpackb(encode_payload(list(ours.values()), ts=1.5), raw=False)
    real_payload = msgpack.unpackb(next(iter(sorted(SAMPLES.glob("*.msgpack")))).read_bytes(), raw=False)
    assert [type(x) for x in payload] == [type(x) for x in real_payload] == [float, list, int]
    for event in payload[1]:
        reference = real[event["type"]]
        assert list(event) == list(reference), event["type"]  # same keys, same order, "type" first
        for key, value in event.items():
            ref = reference[key]
            if ref is not None and value is not None:
                assert type(value) is type(ref), (event["type"], key)
    stored = payload[1][0]
    assert stored["medium"] == "GPU" and stored["group_idx"] == 0
    assert stored["kv_cache_spec_kind"] == "full_attention"


def record_from_wire(event: dict[str, Any]) -> Any:
    """Test-side conversion of a decoded vLLM event into our record type."""
    if event["type"] == "BlockStored":
        return BlockStored(event["block_hashes"], event["parent_block_hash"], event["token_ids"], event["block_size"],
                           event["lora_id"], event["lora_name"], event["extra_keys"])  # fmt: skip
    if event["type"] == "BlockRemoved":
        return BlockRemoved(event["block_hashes"])
    return AllBlocksCleared()


def test_re_encoding_every_captured_payload_reproduces_its_bytes() -> None:
    paths = sorted(SAMPLES.glob("*.msgpack"))
    assert len(paths) >= 10
    for path in paths:
        raw = path.read_bytes()
        ts, events, dp_rank = msgpack.unpackb(raw, raw=False)
        ours = encode_payload([record_from_wire(e) for e in events], ts=ts, dp_rank=dp_rank)
        assert ours == raw, path.name


def test_large_hashes_are_msgpack_uint64_like_vllm() -> None:
    raw = encode_payload([BlockRemoved([2**64 - 1])], ts=0.0)
    assert b"\xcf" + (2**64 - 1).to_bytes(8, "big") in raw
    # the captured payload also encodes its hashes as uint64
    real = (SAMPLES / "sha256-seq016.msgpack").read_bytes()
    assert b"\xcf" in real


def test_message_frames() -> None:
    frames = encode_message([AllBlocksCleared()], seq=258, topic="kv-events", ts=2.0)
    assert frames[0] == b"kv-events"
    assert frames[1] == (258).to_bytes(8, "big")
    assert msgpack.unpackb(frames[2]) == [2.0, [{"type": "AllBlocksCleared"}], 0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_pod_publishes_block_events_to_a_bound_sub_socket() -> None:
    port = free_port()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind(f"tcp://127.0.0.1:{port}")
    messages: list[list[bytes]] = []

    async def collect() -> None:
        # a consumer sits in recv, so libzmq attaches the connecting PUB and forwards the subscription
        while True:
            messages.append(await sub.recv_multipart())

    collector = asyncio.create_task(collect())
    try:
        async with SimFleet(
            1, profile="tiny-cpu", time_scale=50.0, kv_events_endpoint_base=f"tcp://127.0.0.1:{port}",
            profile_overrides={"block_size": 16, "num_gpu_blocks": 7},
        ) as fleet:  # fmt: skip
            await asyncio.sleep(0.3)  # PUB connect + subscription propagation (slow joiner)
            prompt = list(range(300, 340))  # 2 full blocks of 16
            async with aiohttp.ClientSession() as http:
                # 3 different prompts of 3 blocks (2 full + 1 partial) through 6 usable blocks force an eviction
                for base in (300, 400, 500):
                    body = {"prompt": list(range(base, base + 40)), "max_tokens": 2}
                    async with http.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
            for _ in range(50):
                if sum(1 for m in messages if b"BlockRemoved" in m[2]):
                    break
                await asyncio.sleep(0.05)
        assert messages, "no KV events received"
        seqs = [int.from_bytes(m[1], "big") for m in messages]
        assert seqs == list(range(len(seqs)))
        assert all(m[0] == b"kv-events" for m in messages)
        events = [e for m in messages for e in msgpack.unpackb(m[2], raw=False)[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert stored[0]["block_hashes"] == block_hashes(prompt, 16)
        assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == prompt[:32]
        assert removed, "the small cache should have evicted blocks"
        assert all(len(e["block_hashes"]) == 1 for e in removed)
    finally:
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
        sub.close()
        ctx.term()
