"""The simulator's host-memory tier (vLLM's OffloadingConnector, CPU): prompt blocks are copied there as they are
computed, a prompt whose prefix the device evicted loads it back from there at the tier's cost, and the KV events
say so with medium CPU (hash-only stores, as the connector sends them by default)."""

from __future__ import annotations

from picker.kvevents.events import BlockRemoved, BlockStored, KVEvent
from picker.prefix.precise import PreciseIndex, token_keys
from picker_lab.sim.engine import Engine, SimRequest
from picker_lab.sim.profiles import TINY_CPU
from tests.sim.test_sim_engine import BS, run_until_idle, serve_one


def make_engine(cpu_blocks: int, gpu_blocks: int = 1 + 11) -> Engine:
    profile = TINY_CPU.with_overrides(block_size=BS, num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks,
                                      max_model_len=256, max_num_batched_tokens=4096, max_num_seqs=16)
    return Engine(profile, record_kv_events=True)


def test_a_prefix_the_device_evicted_is_loaded_from_host_memory_for_less_than_its_compute() -> None:
    prompt_a = list(range(1000, 1000 + 161))  # 10 full blocks
    prompt_b = list(range(5000, 5000 + 161))
    results = {}
    for cpu_blocks in (0, 64):
        engine = make_engine(cpu_blocks)
        cold = serve_one(engine, "a1", prompt_a, 0.0)
        serve_one(engine, "b", prompt_b, 10.0)  # 11 device blocks: b evicts all of a's
        assert engine.probe_prefix_hit_tokens(prompt_a) == 0
        again = serve_one(engine, "a2", prompt_a, 20.0)
        results[cpu_blocks] = (cold, again, engine)
    cold, again, engine = results[64]
    assert again.num_cached_tokens == 160  # the whole prefix, from host memory
    assert engine.stats.prefix_cache_hits == 0 and engine.stats.external_hits == 160
    no_tier = results[0][1]
    assert no_tier.num_cached_tokens == 0
    assert again.ttft is not None and no_tier.ttft is not None and cold.ttft is not None
    assert again.ttft < no_tier.ttft * 0.5  # loading costs a tenth of computing
    assert again.ttft > cold.ttft * 0.05  # ... but it is not free


def served(engine: Engine, rid: str, prompt: list[int], now: float) -> list[KVEvent]:
    """Serve one request to the end; the KV events its steps raised."""
    engine.add_request(SimRequest(rid, prompt, 4), now)
    _, results = run_until_idle(engine, now)
    return [e for r in results for e in r.kv_events]


def test_the_tier_is_an_lru_of_its_size_and_its_events_follow_it() -> None:
    engine = make_engine(cpu_blocks=12)
    events = served(engine, "a", list(range(1000, 1000 + 161)), 0.0)  # 10 prompt blocks offloaded
    events += served(engine, "b", list(range(5000, 5000 + 81)), 10.0)  # 5 more: a's 3 oldest leave the tier
    host_stores = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    host_removals = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert [len(e.block_hashes) for e in host_stores] == [10, 5] and all(e.placeholder for e in host_stores)
    assert sum(len(e.block_hashes) for e in host_removals) == 3
    assert len(engine.kv.host) == 12


def test_the_picker_follows_the_tier_from_the_events() -> None:
    engine = make_engine(cpu_blocks=64)
    prompt_a = list(range(1000, 1000 + 161))
    index = PreciseIndex()
    index.apply("pod", served(engine, "a", prompt_a, 0.0) + served(engine, "b", list(range(5000, 5000 + 161)), 10.0),
                now=20.0)
    match = index.pod("pod").match(token_keys(prompt_a, BS), 20.0)
    assert (match.device, match.offloaded) == (0, 10)
    index.apply("pod", served(engine, "a again", prompt_a, 30.0), now=40.0)  # loaded back into the device
    assert index.pod("pod").match(token_keys(prompt_a, BS), 40.0).device == 10
