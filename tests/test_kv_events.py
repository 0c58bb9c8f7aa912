"""KV events into the precise view: the decoder on real vLLM 0.32 payloads (and the older positional form), the
per-pod cache they build (stored, removed, cleared, keyed by our own hash of the token ids), and the subscriber
keeping each pod's stream in order (gaps filled by replay, or the view reset; a restarted publisher)."""

from __future__ import annotations

import msgpack
import pytest

from picker.kvevents.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedEvent,
    decode_event,
    decode_message,
    decode_payload,
)
from picker.kvevents.subscriber import KVEventSubscriber, topic_host
from picker.prefix.precise import PreciseIndex, token_keys
from picker_lab.sim.kv_events import encode_message, encode_payload
from tests.sim.test_sim_kv_events import SAMPLES


def captured(name: str) -> bytes:
    return (SAMPLES / f"{name}.msgpack").read_bytes()


def test_real_payloads_decode_to_our_records() -> None:
    ts, events, dp_rank = decode_payload(captured("sha256-seq016"))
    assert dp_rank == 0 and ts > 1.7e9
    assert isinstance(events[0], AllBlocksCleared)
    stored = events[1]
    assert isinstance(stored, BlockStored)
    assert stored.block_size == 128 and len(stored.block_hashes) == 2 and stored.token_ids[:3] == [100, 101, 102]
    assert stored.parent_block_hash is None and stored.lora_name is None
    _, lora, _ = decode_payload(captured("sha256-seq017"))
    assert isinstance(lora[0], BlockStored) and lora[0].lora_name == "tinylora" and lora[0].lora_id == 1
    _, evicted, _ = decode_payload(captured("sha256-seq022"))
    assert [type(e) for e in evicted[:2]] == [BlockRemoved, BlockRemoved]
    for path in sorted(SAMPLES.glob("*.msgpack")):  # every captured one decodes, and re-encodes to its bytes
        ts, events, dp_rank = decode_payload(path.read_bytes())
        assert encode_payload(events, ts=ts, dp_rank=dp_rank) == path.read_bytes(), path.name
    big = [h for e in (decode_payload(p.read_bytes())[1] for p in SAMPLES.glob("*.msgpack")) for x in e
           if isinstance(x, BlockStored) for h in x.block_hashes]
    assert any(isinstance(h, int) and h >= 2**63 for h in big)  # uint64 hashes stay unsigned


def test_the_older_positional_form_decodes_too() -> None:
    stored = decode_event(["BlockStored", [7, 8], None, list(range(8)), 4, None, "GPU"])
    assert stored == BlockStored([7, 8], None, list(range(8)), 4, None, None, [None, None])
    assert decode_event(["BlockRemoved", [7], "GPU"]) == BlockRemoved([7])
    assert decode_event(["AllBlocksCleared"]) == AllBlocksCleared()
    ts, events, dp = decode_payload(msgpack.packb([1.0, [["BlockRemoved", [9]]]]))  # no dp_rank: 0
    assert (ts, events, dp) == (1.0, [BlockRemoved([9])], 0)


@pytest.mark.parametrize("raw", [
    {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 4},  # 2 tokens for a block of 4
    {"type": "BlockStored", "block_hashes": ["x"], "token_ids": [1], "block_size": 1},
    {"type": "BlockRemoved"}, {"type": "Nope"}, 42, [],
])
def test_malformed_events_are_refused_with_a_reason(raw: object) -> None:
    with pytest.raises(MalformedEvent):
        decode_event(raw)


def test_malformed_messages_are_refused() -> None:
    for frames in ([b"t", b"\x00" * 8], [b"t", b"\x00", encode_payload([])], [b"t", b"\x00" * 8, b"\xc1"],
                   [b"t", b"\x00" * 8, msgpack.packb({"a": 1})], [b"\xff", b"\x00" * 8, encode_payload([])]):
        with pytest.raises(MalformedEvent):
            decode_message(frames)


def stored(tokens: list[int], block_size: int, hashes: list[int], parent: int | None = None,
           lora: str | None = None) -> BlockStored:
    return BlockStored(list[BlockHash](hashes), parent, tokens, block_size, 1 if lora else None, lora, [None] * len(hashes))


def test_the_index_mirrors_stores_removals_and_clears_keyed_by_token_ids() -> None:
    index = PreciseIndex()
    tokens = list(range(100, 116))  # 4 blocks of 4
    keys = token_keys(tokens, 4)
    index.apply("pod", [stored(tokens[:8], 4, [11, 12])], now=0.0)
    index.apply("pod", [stored(tokens[8:], 4, [13, 14], parent=12)], now=0.0)  # the chain continues
    cache = index.pod("pod")
    assert cache.matched(keys, 0.0) == 4
    assert cache.matched(token_keys(tokens, 4, adapter="sql-lora"), 0.0) == 0  # an adapter's blocks differ
    index.apply("pod", [BlockRemoved([13])], now=1.0)  # vLLM evicts from the tail
    assert cache.matched(keys, 1.0) == 2
    index.apply("pod", [stored([1, 2, 3, 4], 4, [99], parent=12345)], now=1.0)  # an unknown parent: not keyed
    assert 99 not in cache.keys
    index.apply("pod", [AllBlocksCleared()], now=2.0)
    assert cache.matched(keys, 2.0) == 0 and not cache.keys
    lora = list(range(8))
    index.apply("pod", [stored(lora, 4, [21, 22], lora="sql-lora")], now=3.0)
    assert cache.matched(token_keys(lora, 4, adapter="sql-lora"), 3.0) == 2


def test_a_cache_salt_makes_its_own_chain() -> None:
    """vLLM puts the salt in the first block's extra keys (after the adapter's name): only requests with the same
    salt hit those blocks."""
    index = PreciseIndex()
    tokens = list(range(8))
    salted = BlockStored([1, 2], None, tokens, 4, 1, "sql-lora", [["sql-lora", "tenant-a"], ["sql-lora"]])
    index.apply("pod", [salted, stored(tokens, 4, [3, 4])], now=0.0)
    cache = index.pod("pod")
    assert cache.matched(token_keys(tokens, 4, "sql-lora", salt="tenant-a"), 0.0) == 2
    assert cache.matched(token_keys(tokens, 4, "sql-lora"), 0.0) == 0
    assert cache.matched(token_keys(tokens, 4, "sql-lora", salt="tenant-b"), 0.0) == 0
    assert cache.matched(token_keys(tokens, 4), 0.0) == 2  # the unsalted base-model blocks


def test_blocks_of_a_media_item_match_no_prompt_by_its_tokens_alone() -> None:
    """vLLM keys the blocks holding an image's placeholder tokens on the item's identifier (in the event: an
    `[identifier, offset]` pair among the block's extra keys). Two images of one size after the same text have the
    same placeholder tokens: keyed by tokens alone, each pod would seem to hold the other's. The text before the
    item still matches; nothing from the item on does."""
    index = PreciseIndex()
    text, image = list(range(100, 108)), [7] * 8  # two blocks of text, then two of one image's placeholders
    after = list(range(200, 204))
    tokens = text + image + after
    for pod, identifier in (("a", "img-a"), ("b", "img-b")):
        extras = [None, None, [[identifier, 0]], [[identifier, -4]], None]
        index.apply(pod, [BlockStored([1, 2, 3, 4, 5], None, tokens, 4, None, None, extras)], now=0.0)
    keys = token_keys(tokens, 4)
    assert index.pod("a").matched(keys, 0.0) == 2 and index.pod("b").matched(keys, 0.0) == 2
    assert index.pod("a").keys[3] != index.pod("b").keys[3]  # the two images' blocks are apart
    assert index.pod("a").keys[5] != index.pod("b").keys[5]  # and so is the text after them
    lora = BlockStored([6], None, text[:4], 4, 1, "sql-lora", [["sql-lora"]])  # an adapter's name alone: as before
    index.apply("c", [lora], now=0.0)
    assert index.pod("c").matched(token_keys(text[:4], 4, "sql-lora"), 0.0) == 1


def test_speculative_entries_hold_until_stored_or_expired() -> None:
    index = PreciseIndex(speculative_s=2.0)
    tokens = list(range(12))
    keys = token_keys(tokens, 4)
    index.apply("pod", [], now=0.0)
    index.picked("pod", keys, now=0.0)
    assert index.pod("pod").matched(keys, 1.0) == 3  # believed while the pod computes it
    assert index.pod("pod").matched(keys, 2.5) == 0  # never confirmed: gone
    index.picked("pod", keys, now=3.0)
    index.apply("pod", [stored(tokens[:8], 4, [1, 2])], now=3.1)  # two blocks confirmed, the third still believed
    assert index.pod("pod").matched(keys, 4.0) == 3 and index.pod("pod").matched(keys, 9.0) == 2


def test_a_pod_is_trusted_only_while_its_events_account_for_its_work() -> None:
    index = PreciseIndex(resync_s=30.0, lag_s=2.0, lag_blocks=2)
    assert not index.fresh("pod", 0.0)  # no events yet
    index.apply("pod", [stored(list(range(8)), 4, [1, 2])], now=10.0)
    index.observe_scrape("pod", misses=8, scraped_at=10.5)  # the scrape right after: the batch's work
    assert index.fresh("pod", 11.0)
    index.observe_scrape("pod", misses=12, scraped_at=20.0)  # one block more, no events: within the allowance
    assert index.fresh("pod", 20.0)
    index.observe_scrape("pod", misses=40, scraped_at=21.0)  # 8 blocks of work we never heard of
    assert not index.fresh("pod", 21.0)
    index.apply("pod", [stored(list(range(4)), 4, [3])], now=22.0)  # events flow again
    assert index.fresh("pod", 22.0)
    index.reset("pod", now=30.0)
    assert not index.fresh("pod", 40.0) and index.fresh("pod", 60.5)


class Buffered:
    """A pod's replay buffer in memory (the real one is vLLM's ROUTER socket: see the sim test)."""

    def __init__(self, messages: dict[int, list[bytes]] | None, rank: int = 0) -> None:
        self.messages = messages
        self.rank = rank  # the data-parallel rank whose replay socket this is (another rank's: nothing)

    async def fetch(self, host: str, start: int, stop: int, dp_rank: int = 0) -> list[EventBatch] | None:
        if self.messages is None or dp_rank != self.rank:
            return None
        return [decode_message(self.messages[s]) for s in range(start, stop) if s in self.messages]


def subscriber(index: PreciseIndex, replay: dict[int, list[bytes]] | None) -> KVEventSubscriber:
    """Messages handed to `receive` as the socket would; one pod in the pool."""
    return KVEventSubscriber("tcp://127.0.0.1:0", index, {"10.0.0.1:8000": "10.0.0.1:8000"}.get,
                             replayer=Buffered(replay), clock=lambda: 100.0)


TOPIC = "kv@10.0.0.1:8000@llama"


def message(seq: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> list[bytes]:
    return encode_message(list(events), seq, TOPIC, ts=float(seq))


async def test_the_subscriber_keeps_order_fills_gaps_from_replay_and_follows_a_restart() -> None:
    tokens = list(range(16))
    keys = token_keys(tokens, 4)
    msgs = {0: message(0, stored(tokens[:4], 4, [1])), 1: message(1, stored(tokens[4:8], 4, [2], parent=1)),
            2: message(2, stored(tokens[8:12], 4, [3], parent=2)), 3: message(3, stored(tokens[12:], 4, [4], parent=3))}
    index = PreciseIndex()
    sub = subscriber(index, replay=msgs)
    await sub.receive(msgs[0])
    await sub.receive(msgs[1])
    await sub.receive(msgs[1])  # a duplicate
    await sub.receive(msgs[3])  # 2 lost: replayed first
    assert index.pod("10.0.0.1:8000").matched(keys, 100.0) == 4 and index.fresh("10.0.0.1:8000", 100.0)
    assert (sub.stats.duplicates, sub.stats.gaps, sub.stats.resets) == (1, 1, 0)
    await sub.receive(message(0, stored(tokens[:4], 4, [7])))  # the pod restarted: its view starts over, trusted
    assert index.pod("10.0.0.1:8000").matched(keys, 100.0) == 1 and index.fresh("10.0.0.1:8000", 100.0)
    await sub.receive(encode_message([], 0, "kv@10.9.9.9:1@llama"))  # no such pod
    await sub.receive([b"x"])
    assert (sub.stats.unknown_topic, sub.stats.malformed) == (1, 1)


async def test_a_gap_nothing_can_fill_resets_and_distrusts_the_view() -> None:
    tokens = list(range(8))
    index = PreciseIndex(resync_s=30.0)
    sub = subscriber(index, replay=None)
    await sub.receive(message(0, stored(tokens[:4], 4, [1])))
    await sub.receive(message(5, stored(tokens[4:], 4, [2], parent=1)))  # 1..4 lost, no replay
    cache = index.pod("10.0.0.1:8000")
    assert cache.matched(token_keys(tokens, 4), 100.0) == 0  # its parent was forgotten with the rest
    assert not index.fresh("10.0.0.1:8000", 100.0) and sub.stats.resets == 1 and sub.next_seq["10.0.0.1:8000", 0] == 6


def test_topics_name_their_pod() -> None:
    assert topic_host("kv@10.0.0.1:8000@meta-llama/Llama-3") == "10.0.0.1:8000"
    assert topic_host("kv@10.0.0.1@llama") == "10.0.0.1"
    assert topic_host("kv-events") is None and topic_host("kv@@x") is None


def test_the_scheduler_scores_what_the_pods_events_say_they_hold() -> None:
    from picker.core.requests import ApiKind, InferenceRequest
    from picker.endpoints.state import Endpoint, EndpointMetrics
    from picker.prefix.precise import PrecisePrefix
    from picker.prefix.tokens import given_token_ids
    from picker.scheduling.config import build_scheduler

    index = PreciseIndex()
    pods = [Endpoint.from_address(f"10.0.0.{i}:8000") for i in (1, 2)]
    for pod in pods:
        pod.metrics = EndpointMetrics(block_size=4, updated_at=0.0)
    tokens = list(range(1000, 1400))  # 100 blocks of 4
    index.apply(pods[0].address, [], now=0.0)
    index.apply(pods[1].address, [stored(tokens, 4, list(range(1, 101)))], now=0.0)  # pod 2 holds it all
    request = InferenceRequest("r", "m", api=ApiKind.COMPLETIONS, prompt_text="x" * 1600, token_ids=tokens)
    for mode in ("auto", "precise"):
        scheduler = build_scheduler(precise=PrecisePrefix(index, mode))  # type: ignore[arg-type]
        result = scheduler.schedule(request, pods, now=1.0)
        assert result.ranked[0] is pods[1] and result.context is not None
        assert result.context.matches == {pods[1].address: len(result.context.keys)}
        explained = {c.endpoint.address: c.details for c in result.candidates}  # what Explain shows of each
        assert explained[pods[1].address]["prefix.precise"] == 1.0
        assert explained[pods[1].address]["prefix.expected_chars"] == len(result.context.keys) * \
            result.context.block_chars
        assert explained[pods[0].address]["prefix.expected_chars"] == 0.0
        scheduler.on_picked(result.context, pods[1], 1.0)
    # a pod whose view was reset is scored from the approximate index in auto mode (this scheduler's knows nothing)
    index.reset(pods[1].address, now=1.0)
    auto = build_scheduler(precise=PrecisePrefix(index, "auto")).schedule(request, pods, now=2.0)
    assert auto.context is not None and auto.context.precise_keys and auto.context.matches == {}
    assert not index.fresh(pods[1].address, 2.0) and index.fresh(pods[0].address, 2.0)
    assert given_token_ids([1, 2, 3]) == [1, 2, 3] and given_token_ids("text") is None
    assert given_token_ids([True]) is None and given_token_ids([[1, 2]]) is None


def rank_message(rank: int, seq: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> list[bytes]:
    return encode_message(list(events), seq, TOPIC, ts=float(seq), dp_rank=rank)


async def test_each_data_parallel_rank_is_a_stream_of_its_own_feeding_its_rank_view() -> None:
    # vLLM's engines of one server each publish under the server's topic, with their own sequence from 0
    tokens = list(range(8))
    keys = token_keys(tokens, 4)
    index = PreciseIndex()
    rank1 = {1: rank_message(1, 1, stored(tokens[4:], 4, [12], parent=11))}
    sub = KVEventSubscriber("tcp://127.0.0.1:0", index, {"10.0.0.1:8000": "10.0.0.1:8000"}.get,
                            target_of=lambda address, rank: f"{address}#{rank}", replayer=Buffered(rank1, rank=1),
                            clock=lambda: 100.0)
    await sub.receive(rank_message(0, 0, stored(tokens[:4], 4, [1])))
    await sub.receive(rank_message(0, 1, stored(tokens[4:], 4, [2], parent=1)))
    await sub.receive(rank_message(1, 0, stored(tokens[:4], 4, [11])))  # rank 1's first: no restart of rank 0
    await sub.receive(rank_message(1, 2, stored([9] * 4, 4, [13])))  # rank 1's 1 lost: replayed from its socket
    assert index.pod("10.0.0.1:8000#0").matched(keys, 100.0) == 2
    assert index.pod("10.0.0.1:8000#1").matched(keys, 100.0) == 2
    assert (sub.stats.resets, sub.stats.gaps, sub.stats.replayed) == (0, 1, 1)
    assert sub.next_seq == {("10.0.0.1:8000", 0): 2, ("10.0.0.1:8000", 1): 3}
    assert "10.0.0.1:8000" not in index.pods  # nothing of a ranked server goes to a view of the whole
    sub.restart_streams("10.0.0.1:8000")  # its views were dropped (the pool merged its ranks, say)
    assert sub.next_seq == {}


async def test_a_server_routed_as_one_gets_every_ranks_blocks_in_its_view() -> None:
    index = PreciseIndex()
    sub = subscriber(index, replay=None)
    await sub.receive(rank_message(0, 0, stored(list(range(4)), 4, [1])))
    await sub.receive(rank_message(1, 0, stored(list(range(10, 14)), 4, [2])))
    await sub.receive(rank_message(0, 1, stored(list(range(4, 8)), 4, [3], parent=1)))
    cache = index.pod("10.0.0.1:8000")
    assert cache.matched(token_keys(list(range(8)), 4), 100.0) == 2
    assert cache.matched(token_keys(list(range(10, 14)), 4), 100.0) == 1
    assert sub.stats.resets == 0 and sub.stats.gaps == 0
