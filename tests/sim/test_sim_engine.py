"""Engine and KV-cache behaviour that routing quality depends on (block accounting, eviction, batching)."""

from __future__ import annotations

from picker.kvevents.events import BlockRemoved, BlockStored
from picker_lab.sim.engine import Engine, FinishedRequest, SimRequest, StepResult
from picker_lab.sim.kvcache import NONE_HASH, block_hashes, extend_block_hashes, extra_keys_for, hash_block
from picker_lab.sim.profiles import TINY_CPU, get_profile

BS = 16


def make_engine(**overrides: object) -> Engine:
    base: dict[str, object] = {"block_size": BS, "num_gpu_blocks": 1 + 64, "max_model_len": 1024,
                               "max_num_batched_tokens": 4096, "max_num_seqs": 16}  # fmt: skip
    base.update(overrides)
    record = bool(base.pop("record", False))
    return Engine(TINY_CPU.with_overrides(**base), record_kv_events=record)


def run_until_idle(engine: Engine, now: float = 0.0) -> tuple[float, list[StepResult]]:
    results = []
    while engine.has_work():
        t = engine.next_step_time()
        assert t is not None
        result = engine.step(max(now, t))
        now = result.end
        results.append(result)
        assert len(results) < 100_000
    return now, results


def finished(results: list[StepResult]) -> dict[str, FinishedRequest]:
    return {f.request_id: f for r in results for f in r.finished}


def serve_one(engine: Engine, rid: str, prompt: list[int], now: float, max_tokens: int = 4) -> FinishedRequest:
    engine.add_request(SimRequest(rid, prompt, max_tokens), now)
    _, results = run_until_idle(engine, now)
    return finished(results)[rid]


def test_same_prompt_twice_hits_full_blocks_but_never_the_last_token() -> None:
    engine = make_engine()
    for length, expect in ((160, 144), (161, 160), (15, 0), (16, 0), (17, 16)):
        engine = make_engine()
        prompt = list(range(1000, 1000 + length))
        first = serve_one(engine, "a", prompt, 0.0)
        second = serve_one(engine, "b", prompt, 10.0)
        assert first.num_cached_tokens == 0
        # hits come in whole blocks, at most (len - 1) // block_size of them
        assert second.num_cached_tokens == expect, length
        assert engine.probe_prefix_hit_tokens(prompt) == expect
    assert engine.stats.prefix_cache_queries == 2 * 17
    assert engine.stats.prefix_cache_hits == 16


def test_shared_prefix_hits_only_the_shared_full_blocks() -> None:
    engine = make_engine()
    shared = list(range(5000, 5000 + 180))  # 90 % of 200 tokens
    a = shared + list(range(1, 21))
    b = shared + list(range(101, 121))
    serve_one(engine, "a", a, 0.0)
    fin = serve_one(engine, "b", b, 5.0)
    assert fin.num_cached_tokens == (180 // BS) * BS == 176
    # a different cache_salt or LoRA changes every hash: no hit
    assert engine.probe_prefix_hit_tokens(b, cache_salt="tenant-2") == 0


def test_identical_prompts_admitted_in_the_same_step_share_the_prefill() -> None:
    engine = make_engine(record=True)
    prompt = list(range(4000, 4100))  # 6 full blocks + 4 tokens
    engine.add_request(SimRequest("a", prompt, 2), 0.0)
    engine.add_request(SimRequest("b", prompt, 2), 0.0)
    first = engine.step(0.0)
    assert first.num_prefill_tokens == 100 + 4  # b computes only what follows a's 6 full blocks
    stored = [h for e in first.kv_events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == block_hashes(prompt, BS)  # stored once, by a
    _, results = run_until_idle(engine, first.end)
    assert finished(results)["b"].num_cached_tokens == 96


def test_cached_prompt_has_lower_ttft_than_cold() -> None:
    engine = make_engine()
    prompt = list(range(2000, 2600))
    cold = serve_one(engine, "a", prompt, 0.0)
    warm = serve_one(engine, "b", prompt, 100.0)
    assert cold.ttft is not None and warm.ttft is not None
    assert warm.ttft < cold.ttft / 2


def test_lru_eviction_order_frees_tail_blocks_first_and_oldest_requests_first() -> None:
    # 11 usable blocks; a request of 64 tokens and max_tokens=1 uses 4 full blocks.
    engine = make_engine(num_gpu_blocks=12, record=True)
    p1 = list(range(10_000, 10_064))
    p2 = list(range(20_000, 20_064))
    p3 = list(range(30_000, 30_064))
    serve_one(engine, "r1", p1, 0.0, max_tokens=1)
    serve_one(engine, "r2", p2, 1.0, max_tokens=1)
    assert engine.kv.has_room()  # three blocks never used
    h1 = block_hashes(p1, BS)
    h2 = block_hashes(p2, BS)
    engine.add_request(SimRequest("r3", p3, 1), 2.0)
    _, results = run_until_idle(engine, 2.0)
    assert finished(results)["r3"].num_cached_tokens == 0
    events = [e for r in results for e in r.kv_events]
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    # free queue before r3: [3 never-used blocks, r1 (h1[3], h1[2], h1[1], h1[0]), r2 (h2[3], ..., h2[0])]
    # r3 needs 4 blocks: the 3 unused ones, then r1's *last* block (a finished request's tail goes first).
    assert removed == [h1[3]]
    assert not engine.kv.has_room()  # every free block holds a cached prefix now: the next allocation evicts
    # r1's first three blocks and all of r2's remain cached
    assert engine.probe_prefix_hit_tokens(p1 + [1]) == 3 * BS
    assert engine.probe_prefix_hit_tokens(p2 + [1]) == 4 * BS
    assert all(h in engine.kv.cached for h in h2)


def test_cache_hit_takes_block_out_of_free_queue_and_refreshes_it() -> None:
    engine = make_engine(num_gpu_blocks=13)
    p1 = list(range(10_000, 10_064))
    p2 = list(range(20_000, 20_064))
    serve_one(engine, "r1", p1, 0.0, max_tokens=1)
    serve_one(engine, "r2", p2, 1.0, max_tokens=1)
    serve_one(engine, "r1-again", p1 + [7], 2.0, max_tokens=1)  # touches r1's blocks: now most recent
    # free queue now: [r1-again's partial block, 3 unused, r2's blocks (tail first), r1's blocks (tail first)]
    serve_one(engine, "r3", list(range(30_000, 30_096)), 3.0, max_tokens=1)  # 6 blocks
    # r2 is now the least recently used and loses its tail blocks instead of r1
    assert engine.probe_prefix_hit_tokens(p1 + [1]) == 4 * BS
    assert engine.probe_prefix_hit_tokens(p2 + [1]) < 4 * BS


def test_partial_blocks_are_reused_before_cached_blocks_are_evicted() -> None:
    # 6 usable blocks; 40-token prompts + 2 output tokens use 2 full blocks and 1 partial block each
    engine = make_engine(num_gpu_blocks=7, record=True)
    prompts = [list(range(base, base + 40)) for base in (300, 400, 500)]
    serve_one(engine, "a", prompts[0], 0.0, max_tokens=2)
    serve_one(engine, "b", prompts[1], 1.0, max_tokens=2)
    # free queue: [b's partial, 2 unused, a's 2 cached blocks, b's 2 cached blocks]: c evicts exactly one block
    engine.add_request(SimRequest("c", prompts[2], 2), 2.0)
    _, results = run_until_idle(engine, 2.0)
    removed = [e.block_hashes[0] for r in results for e in r.kv_events if isinstance(e, BlockRemoved)]
    assert removed == [block_hashes(prompts[0], BS)[1]]  # a's last cached block
    assert engine.kv.has_room()  # c's partial block went back to the head of the free queue, uncached
    assert engine.probe_prefix_hit_tokens(prompts[0] + [0]) == BS
    assert engine.probe_prefix_hit_tokens(prompts[1] + [0]) == 2 * BS


def test_admission_needs_room_for_the_whole_prompt_not_just_the_first_chunk() -> None:
    # 10 usable blocks, 64-token chunks: a 150-token prompt (10 blocks) cannot start while another request holds 2,
    # although its first chunk (4 blocks) would fit
    engine = make_engine(num_gpu_blocks=11, max_num_batched_tokens=64)
    engine.add_request(SimRequest("small", list(range(100, 120)), 30), 0.0)
    first = engine.step(0.0)
    engine.add_request(SimRequest("big", list(range(1000, 1150)), 1), first.end)
    engine.step(first.end)
    assert engine.num_waiting == 1 and [s.req.request_id for s in engine.running] == ["small"]
    _, results = run_until_idle(engine, first.end)
    fins = finished(results)
    assert fins["big"].first_scheduled_time is not None
    assert fins["big"].first_scheduled_time >= fins["small"].finish_time


def test_kv_usage_counts_blocks_in_use_over_usable_blocks() -> None:
    engine = make_engine(num_gpu_blocks=11)
    engine.add_request(SimRequest("a", list(range(100, 132)), 100), 0.0)
    first = engine.step(0.0)
    # 32 prompt tokens -> 2 of 10 usable blocks; the sampled token gets its slot when its decode is scheduled
    assert abs(engine.kv_usage() - 0.2) < 1e-9
    engine.step(first.end)
    assert abs(engine.kv_usage() - 0.3) < 1e-9
    run_until_idle(engine)
    assert engine.kv_usage() == 0.0


def test_preemption_when_blocks_run_out_during_decode() -> None:
    # 8 usable blocks; two requests of 48 tokens (3 blocks each) decoding 40 tokens each need 6 blocks each.
    engine = make_engine(num_gpu_blocks=9)
    engine.add_request(SimRequest("a", list(range(100, 148)), 40), 0.0)
    engine.add_request(SimRequest("b", list(range(200, 248)), 40), 0.0)
    _, results = run_until_idle(engine)
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and preempted[0] == "b"  # the most recently admitted request is preempted first
    fins = finished(results)
    assert fins["b"].num_preemptions >= 1 and fins["a"].num_preemptions == 0
    assert len(fins["a"].output_token_ids) == 40 and len(fins["b"].output_token_ids) == 40
    assert engine.stats.num_preemptions == len(preempted)
    # recompute keeps the tokens already generated: same text as an unpreempted run
    solo = make_engine(num_gpu_blocks=200)
    alone = serve_one(solo, "b", list(range(200, 248)), 0.0, max_tokens=40)
    assert alone.output_token_ids == fins["b"].output_token_ids


def test_queueing_when_max_num_seqs_is_reached() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(SimRequest(f"r{i}", list(range(i * 100, i * 100 + 20)), 8), 0.0)
    engine.step(0.0)
    assert engine.num_running == 2 and engine.num_waiting == 3
    _, results = run_until_idle(engine)
    fins = finished(results)
    # FIFO: r2 starts only after r0/r1 finish
    assert fins["r2"].first_scheduled_time is not None
    assert fins["r2"].first_scheduled_time >= min(fins["r0"].finish_time, fins["r1"].finish_time)
    assert sorted(fins) == [f"r{i}" for i in range(5)]


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request(SimRequest("long", list(range(1000, 1200)), 2), 0.0)
    engine.add_request(SimRequest("short", list(range(3000, 3010)), 2), 0.0)
    first = engine.step(0.0)
    assert first.num_scheduled_tokens == 64 and not first.new_tokens
    _, results = run_until_idle(engine, first.end)
    assert all(r.num_scheduled_tokens <= 64 for r in results)
    fins = finished(results)
    assert fins["long"].ttft is not None and fins["long"].ttft > 3 * first.duration


def test_step_time_grows_with_prefill_and_decode_load() -> None:
    p = get_profile("llama3-8b-h100")
    engine = Engine(p)
    engine.add_request(SimRequest("a", list(range(100, 2100)), 1), 0.0)
    big = engine.step(0.0)
    engine2 = Engine(p)
    engine2.add_request(SimRequest("b", list(range(100, 200)), 1), 0.0)
    small = engine2.step(0.0)
    assert big.duration > small.duration > p.step_overhead_s
    assert 0.05 < big.duration < 0.2  # ~85 ms for a 2k-token prefill of an 8B model on an H100


def test_lora_slots_block_a_second_adapter_and_loading_costs_time() -> None:
    engine = Engine(TINY_CPU.with_overrides(max_loras=1), lora_modules={"l1": "/a", "l2": "/b"}, record_kv_events=True)
    engine.add_request(SimRequest("x", list(range(100, 140)), 3, lora_name="l1"), 0.0)
    engine.add_request(SimRequest("y", list(range(100, 140)), 3, lora_name="l2"), 0.0)
    engine.add_request(SimRequest("z", list(range(500, 540)), 3), 0.0)
    first = engine.step(0.0)
    assert first.loaded_loras == ["l1"]
    assert engine.running_loras() == ["l1"] and engine.waiting_loras() == ["l2"]
    assert {s.req.request_id for s in engine.running} == {"x", "z"}  # y skipped, z not blocked behind it
    assert first.duration >= TINY_CPU.lora_load_s
    _, results = run_until_idle(engine, first.end)
    assert finished(results)["y"].finish_reason == "length"


def test_lora_name_is_part_of_block_hashes_and_events() -> None:
    engine = Engine(TINY_CPU.with_overrides(block_size=16), lora_modules={"tinylora": "/p"}, record_kv_events=True)
    prompt = list(range(100, 140))
    engine.add_request(SimRequest("x", prompt, 1, lora_name="tinylora"), 0.0)
    result = engine.step(0.0)
    stored = [e for e in result.kv_events if isinstance(e, BlockStored)]
    assert stored and stored[0].lora_name == "tinylora" and stored[0].lora_id == 1
    assert stored[0].extra_keys == [["tinylora"], ["tinylora"]]
    assert stored[0].block_hashes == block_hashes(prompt, 16, "tinylora")
    assert block_hashes(prompt, 16, "tinylora") != block_hashes(prompt, 16)
    run_until_idle(engine, result.end)
    assert engine.probe_prefix_hit_tokens(prompt, lora_name="tinylora") == 32
    assert engine.probe_prefix_hit_tokens(prompt) == 0


def test_decode_filled_blocks_are_cached_with_their_parent() -> None:
    engine = make_engine(record=True)
    prompt = list(range(100, 120))  # 1 full block + 4 tokens
    engine.add_request(SimRequest("a", prompt, 30), 0.0)
    _, results = run_until_idle(engine)
    stored = [e for r in results for e in r.kv_events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [1, 1, 1]  # prompt block, then two decode-filled blocks
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert stored[2].parent_block_hash == stored[1].block_hashes[0]
    out = finished(results)["a"].output_token_ids
    assert stored[1].token_ids == (prompt + out)[16:32]


def test_incremental_block_hashes_equal_the_plain_chain() -> None:
    tokens = [(i * 7919) % 100_003 for i in range(16 * 9 + 5)]
    for lora, salt in ((None, None), ("l", None), (None, "s"), ("l", "s")):
        expected, parent = [], NONE_HASH
        for i in range(len(tokens) // 16):
            keys = extra_keys_for(i, lora, salt)
            parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16], "\x00".join(keys).encode() if keys else b"")
            expected.append(parent)
        assert block_hashes(tokens, 16, lora, salt) == expected
        grown: list[int] = []
        for n in (3, 17, 40, 64, 100, len(tokens)):  # extended piecemeal as a request grows
            extend_block_hashes(grown, tokens[:n], 16, lora, salt)
        assert grown == expected
    assert len({block_hashes(tokens, 16, lo, sa)[0] for lo in (None, "l") for sa in (None, "s")}) == 4


def test_same_seed_same_output_different_seed_different_output() -> None:
    prompt = list(range(700, 760))

    def text(seed: int) -> list[int]:
        e = Engine(TINY_CPU, seed=seed)
        e.add_request(SimRequest("a", prompt, 20), 0.0)
        _, results = run_until_idle(e)
        return finished(results)["a"].output_token_ids

    assert text(1) == text(1)
    assert text(1) != text(2)


def test_abort_frees_blocks() -> None:
    engine = make_engine()
    engine.add_request(SimRequest("a", list(range(100, 200)), 50), 0.0)
    engine.step(0.0)
    assert engine.kv_usage() > 0
    fin = engine.abort_request("a", 1.0)
    assert fin is not None and fin.finish_reason == "abort"
    assert engine.kv_usage() == 0.0 and not engine.has_work()


def test_a_remote_prefill_loads_the_prompts_full_blocks_at_transfer_cost() -> None:
    """P/D's decode side: the prompt's full blocks come from the prefill pod (counted as external hits, charged
    at kv_transfer_cost of a prefill), only the last partial block is computed; the blocks are cached after."""
    prompt = list(range(2000, 2000 + 500))  # 31 full blocks and 4 tokens
    local = serve_one(make_engine(), "local", prompt, 0.0)
    engine = make_engine()
    engine.add_request(SimRequest("remote", prompt, 4, remote_prefill=True), 0.0)
    _, results = run_until_idle(engine)
    remote = finished(results)["remote"]
    assert remote.num_cached_tokens == 31 * BS
    assert (engine.stats.external_queries, engine.stats.external_hits) == (500, 31 * BS)
    assert engine.stats.prompt_tokens_external == 31 * BS
    assert remote.ttft is not None and local.ttft is not None and remote.ttft < 0.5 * local.ttft
    again = serve_one(engine, "again", prompt, 100.0)  # loaded blocks are in its prefix cache like computed ones
    assert again.num_cached_tokens == 31 * BS and engine.stats.external_hits == 31 * BS
