"""Cache tiers in the precise view: vLLM's KV-offloading connector reports the blocks it copies to host memory (or
storage) as BlockStored/BlockRemoved with their medium, under the same block hashes as the device's; the view keeps
each medium apart, matches a prompt's device blocks first and the offloaded ones after them (as vLLM loads them),
and weighs an offloaded block by its medium."""

from __future__ import annotations

import msgpack
import pytest

from picker.core.schema import ConfigError
from picker.kvevents.events import BlockHash, BlockRemoved, BlockStored, MalformedEvent, decode_event
from picker.prefix.precise import DEFAULT_MEDIUM_WEIGHTS, PreciseIndex, PrecisePrefix, token_keys
from picker.scheduling.config import build_scheduler
from picker.scheduling.producers import PreciseOverlay
from picker_lab.sim.kv_events import encode_payload
from tests.test_producers import with_plugins

TOKENS = list(range(100, 116))  # 4 blocks of 4
KEYS = token_keys(TOKENS, 4)


def gpu_store(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(list[BlockHash](hashes), parent, tokens, 4, None, None, [None] * len(hashes))


def placeholder(hashes: list[int], medium: str = "CPU") -> BlockStored:
    """What vLLM's offloading connector sends without `self_describing_kv_events`: hashes only."""
    return BlockStored(list[BlockHash](hashes), None, [], 0, None, None, [None] * len(hashes), medium)


def test_the_medium_and_a_tiers_placeholder_decode() -> None:
    stored = decode_event({"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [],
                           "block_size": 0, "lora_id": None, "medium": "cpu", "lora_name": None})
    assert isinstance(stored, BlockStored) and stored.placeholder and stored.medium == "CPU"
    assert decode_event({"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}) == BlockRemoved([7], "CPU")
    assert decode_event({"type": "BlockRemoved", "block_hashes": [7], "medium": None}) == BlockRemoved([7])
    with pytest.raises(MalformedEvent, match="placeholder"):  # a device store always carries its tokens
        decode_event({"type": "BlockStored", "block_hashes": [7], "token_ids": [], "block_size": 0, "medium": "GPU"})
    with pytest.raises(MalformedEvent, match="medium"):
        decode_event({"type": "BlockRemoved", "block_hashes": [7], "medium": 3})
    # the simulator writes the medium as vLLM does, and it comes back
    raw = msgpack.unpackb(encode_payload([placeholder([7]), BlockRemoved([7], "CPU")], ts=0.0), raw=False)
    assert [decode_event(e) for e in raw[1]] == [placeholder([7]), BlockRemoved([7], "CPU")]


def test_a_block_evicted_from_the_device_stays_held_by_its_tier() -> None:
    index = PreciseIndex()
    index.apply("pod", [gpu_store([1, 2, 3, 4], TOKENS), placeholder([1, 2, 3, 4])], now=0.0)
    cache = index.pod("pod")
    assert cache.match(KEYS, 0.0) == (4, 0, 4.0)  # in both: the device copy is the one that counts
    index.apply("pod", [BlockRemoved([3, 4])], now=1.0)  # the device evicts the tail; host memory keeps it
    match = cache.match(KEYS, 1.0)
    assert (match.device, match.offloaded) == (2, 2) and match.worth == pytest.approx(2 + 2 * 0.8)
    assert cache.matched(KEYS, 1.0) == 4
    assert cache.medium_blocks() == {"GPU": 2, "CPU": 4}
    index.apply("pod", [BlockRemoved([4], "CPU")], now=2.0)  # the tier evicts the last block too: gone everywhere
    assert cache.match(KEYS, 2.0) == (2, 1, pytest.approx(2.8)) and 4 not in cache.keys
    index.apply("pod", [gpu_store([3], TOKENS[8:12], parent=2)], now=3.0)  # loaded back into the device
    assert cache.match(KEYS, 3.0) == (3, 0, 3.0)


def test_only_the_device_run_then_the_tiers_run_count() -> None:
    """vLLM takes the device's prefix, then loads what follows from a tier: a device block after an offloaded-only
    one is recomputed, not reused, so the chain counts the tier's run only."""
    index = PreciseIndex()
    index.apply("pod", [gpu_store([1, 2, 3, 4], TOKENS), placeholder([2, 3]), BlockRemoved([2])], now=0.0)
    match = index.pod("pod").match(KEYS, 0.0)
    assert (match.device, match.offloaded) == (1, 2)  # block 4 is only on the device, after the run: not counted


def test_storage_weighs_less_than_host_memory_and_unknown_media_weigh_as_the_least_tier() -> None:
    index = PreciseIndex()
    index.apply("pod", [gpu_store([1, 2, 3, 4], TOKENS), placeholder([1, 2], "STORAGE"), placeholder([3, 4], "LMCACHE"),
                        BlockRemoved([1, 2, 3, 4])], now=0.0)
    match = index.pod("pod").match(KEYS, 0.0, {**DEFAULT_MEDIUM_WEIGHTS, "STORAGE": 0.25})
    assert (match.device, match.offloaded) == (0, 4) and match.worth == pytest.approx(4 * 0.25)
    assert index.pod("pod").match(KEYS, 0.0, {"GPU": 1.0, "CPU": 0.8}).worth == pytest.approx(4 * 0.8)


def test_a_placeholder_for_blocks_never_seen_keys_nothing() -> None:
    index = PreciseIndex()
    index.apply("pod", [placeholder([9])], now=0.0)
    assert not index.pod("pod").keys and index.pod("pod").medium_blocks() == {"GPU": 0, "CPU": 0}


def test_the_weights_are_a_parameter_of_the_precise_producer_strictly_decoded() -> None:
    def build(weights: object) -> PreciseOverlay:
        config = with_plugins({"type": "precise-prefix-cache-producer", "parameters": {"mediumWeights": weights}})
        overlay = build_scheduler(config, precise=PrecisePrefix(PreciseIndex())).producers[-1]
        assert isinstance(overlay, PreciseOverlay)
        return overlay
    assert dict(build({"cpu": 0.9, "STORAGE": 0.1}).medium_weights) == {"GPU": 1.0, "CPU": 0.9, "STORAGE": 0.1}
    with pytest.raises(ConfigError, match="mediumWeights"):
        build({"CPU": 1.5})
    with pytest.raises(ConfigError, match="mediumWeights"):
        build("fast")
