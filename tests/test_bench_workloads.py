"""Workload generators: seeded determinism, sizes in simulator tokens, and the prompt builder's exactness."""

from __future__ import annotations

import statistics

import pytest

from picker.core.requests import build_request
from picker_lab.bench.capacity import smallest_fleet
from picker_lab.bench.oracle import InfiniteCacheOracle
from picker_lab.bench.prompts import PromptBuilder, prompt_text
from picker_lab.bench.workloads import WORKLOADS, FleetSpec, generate, shared_prefix_groups
from picker_lab.sim.openai_api import chat_prompt
from picker_lab.sim.profiles import get_profile
from picker_lab.sim.tokenizer import Tokenizer

PROFILE = get_profile("llama3-8b-h100")
FLEET = FleetSpec(PROFILE, 8)
TOK = Tokenizer(PROFILE.vocab_size)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_seed_same_trace_other_seed_other_trace(name: str) -> None:
    a = generate(name, 200, 20.0, 3, FLEET)
    b = generate(name, 200, 20.0, 3, FLEET)
    c = generate(name, 200, 20.0, 4, FLEET)
    assert a == b
    assert a.requests != c.requests
    assert len(a) == 200
    assert [r.index for r in a.requests] == list(range(200))
    assert all(r.parent < r.index for r in a.requests)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_prompt_builder_matches_the_simulator_tokenizer(name: str) -> None:
    trace = generate(name, 30, 20.0, 1, FleetSpec(PROFILE, 1))
    builder = PromptBuilder(TOK)
    for r in trace.requests:
        if r.parent >= 0:
            continue
        if r.is_chat:
            body = {"messages": [{"role": role, "content": text} for role, text in r.messages]}
            assert builder.chat_ids(r.messages) == chat_prompt(body, TOK)
        else:
            assert builder.completion_ids(r.prompt or ()) == TOK.encode("".join(r.prompt or ()))


def test_prompt_text_is_what_the_picker_parses() -> None:
    import json

    r = generate("chat", 1, 1.0, 1, FLEET).requests[0]
    body = {"model": "m", "messages": [{"role": role, "content": c} for role, c in r.messages]}
    parsed = build_request({":path": "/v1/chat/completions"}, json.dumps(body).encode(), request_id="x")
    assert parsed.prompt_text == prompt_text(r.messages, None)


def _tokens(text: str) -> int:
    return len(TOK.encode(text, add_special_tokens=False))


def test_sizes_in_simulator_tokens() -> None:
    chat = generate("chat", 400, 10.0, 1, FLEET)
    systems = {r.messages[0][1] for r in chat.requests}
    assert len(systems) == 4 and all(_tokens(s) == 256 for s in systems)
    assert all(16 <= _tokens(r.messages[1][1]) <= 64 for r in chat.requests)

    code = generate("code", 400, 10.0, 1, FLEET)
    contexts = {r.prompt[0] for r in code.requests if r.prompt}
    assert all(_tokens(c) == 513 for c in contexts)  # 512 words + the newline before the cursor
    assert len(contexts) < 400 / 4  # bursts share a file context

    summ = generate("summarize", 400, 10.0, 1, FLEET)
    docs = [r.messages[0][1] for r in summ.requests]
    assert all(_tokens(d) == 2048 for d in set(docs))
    assert statistics.mean(docs.count(d) for d in set(docs)) == pytest.approx(4, abs=0.5)

    hot = generate("hot-prefix", 2000, 10.0, 1, FLEET)
    share = sum(r.group == 0 for r in hot.requests) / len(hot)
    assert 0.45 < share < 0.55


def test_multi_turn_conversations_chain_five_turns() -> None:
    trace = generate("multi-turn", 500, 10.0, 1, FLEET)
    children = trace.children()
    firsts = [r for r in trace.requests if r.parent < 0]
    assert len(firsts) == 100
    for first in firsts[:10]:
        chain, i = [first.index], first.index
        while i in children:
            (i,) = children[i]
            chain.append(i)
        assert len(chain) == 5
        assert len({trace.requests[j].session for j in chain}) == 1
    # history ~1k tokens: first turn alone is system + first message
    first_tokens = sum(_tokens(c) for _, c in firsts[0].messages)
    assert 700 <= first_tokens <= 800


def test_shared_prefix_fills_40_to_75_percent_of_the_fleet_cache() -> None:
    for pods in (2, 8, 32):
        fleet = FleetSpec(PROFILE, pods)
        trace = generate("shared-prefix", 100, 10.0, 1, fleet)
        groups = trace.params["num_groups"]
        assert groups == shared_prefix_groups(fleet, 2048, 0.6)
        fill = groups * 2048 / (PROFILE.usable_blocks() * PROFILE.block_size * pods)
        assert 0.4 <= fill <= 0.75
    small = generate("shared-prefix", 50, 10.0, 1, FLEET, num_groups=3, system_prompt_len=64, question_len=8)
    assert {r.group for r in small.requests} <= {0, 1, 2}
    assert all(_tokens(r.messages[0][1]) == 64 for r in small.requests)


def test_poisson_rate_and_bursty_is_burstier() -> None:
    poisson = generate("chat", 4000, 50.0, 1, FLEET)
    assert poisson.requests[-1].at == pytest.approx(4000 / 50.0, rel=0.08)
    bursty = generate("bursty", 4000, 50.0, 1, FLEET)
    assert bursty.requests[-1].at == pytest.approx(4000 / 50.0, rel=0.35)

    def counts(trace: object) -> list[int]:
        out = [0] * 60  # one-second bins inside both traces
        for r in trace.requests:  # type: ignore[attr-defined]
            b = int(r.at)
            if b < 60:
                out[b] += 1
        return out

    assert statistics.pvariance(counts(bursty)) > 3 * statistics.pvariance(counts(poisson))
    ramp = generate("chat", 2000, 50.0, 1, FLEET, arrival="ramp")
    gaps = [b.at - a.at for a, b in zip(ramp.requests, ramp.requests[1:], strict=False)]
    assert statistics.mean(gaps[:200]) > 3 * statistics.mean(gaps[-200:])


def test_oracle_counts_full_blocks_except_the_last_token() -> None:
    oracle = InfiniteCacheOracle(block_size=4)
    first = list(range(1, 11))  # 10 tokens: 2 full blocks
    oracle.on_send(first)
    assert oracle.hits == 0
    oracle.on_send(list(range(1, 9)) + [99, 98])  # shares 2 full blocks
    assert oracle.hits == 8
    oracle.on_send(list(range(1, 9)))  # 8 tokens: the last token is never a hit -> 1 block
    assert oracle.hits == 12
    assert oracle.queries == 28


def test_smallest_fleet_bisects_a_monotone_curve() -> None:
    calls: list[int] = []

    def p95(pods: int) -> float:
        calls.append(pods)
        return 10.0 / pods

    assert smallest_fleet(p95, 1.0, 1, 32) == 10
    assert len(calls) <= 7
    assert smallest_fleet(p95, 0.01, 1, 32) is None


def test_zipf_prefix_popularity_falls_with_rank_and_prefixes_fill_the_cache() -> None:
    small = FleetSpec(PROFILE.with_overrides(num_gpu_blocks=2500), 4)
    trace = generate("zipf-prefix", 4000, 50.0, 1, small)
    groups = trace.params["groups"]
    assert groups == shared_prefix_groups(small, 1024, 0.8)
    counts = [sum(1 for r in trace.requests if r.group == g) for g in range(groups)]
    harmonic = sum(1 / (k + 1) for k in range(groups))
    assert counts[0] == pytest.approx(4000 / harmonic, rel=0.15)  # the most popular: 1/H of the traffic
    assert counts[0] > 1.6 * counts[1] and sum(counts[:10]) > sum(counts[groups // 2:])
    first = {g: next(r for r in trace.requests if r.group == g).messages[0] for g in set(r.group for r in
                                                                                         trace.requests)}
    assert all(r.messages[0] == first[r.group] for r in trace.requests)  # one prefix per group


def test_workload_params_reach_the_trace_and_bad_ones_are_named(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`picker bench --workload-param zipf-prefix.kv_fill=0.5` sizes the trace (half as many prefixes as at 1.0);
    an unknown workload, an unknown key or a value the generator refuses stops the run with exit 2, naming it."""
    import argparse

    from picker_lab.bench.cli import add_arguments, fast_spec
    from picker_lab.bench.cli import main as bench_main
    from picker_lab.bench.suite import _trace

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = fast_spec(parser.parse_args(["--workload", "zipf-prefix", "--pods", "4", "--num-gpu-blocks", "2500",
                                        "--workload-param", "zipf-prefix.kv_fill=0.5",
                                        "--workload-param", "zipf-prefix.zipf_s=1.2"]))
    assert spec.params("zipf-prefix") == {"kv_fill": 0.5, "zipf_s": 1.2} and spec.params("chat") == {}
    half, full = _trace(spec, "zipf-prefix", 20, 10.0), generate("zipf-prefix", 20, 10.0, 1, FleetSpec(
        spec.get_profile(), 4), kv_fill=1.0)
    assert half.params["kv_fill"] == 0.5 and half.params["zipf_s"] == 1.2
    assert abs(2 * half.params["groups"] - full.params["groups"]) <= 1
    for flag, says in (("nope.kv_fill=1", "unknown workload 'nope'"),
                       ("zipf-prefix.kvfill=1", "zipf-prefix has no parameter 'kvfill'"),
                       ("zipf-prefix.arrival=ramp", "has no parameter 'arrival'"),
                       ("zipf-prefix", "expected WORKLOAD.KEY=VALUE"),
                       ("zipf-prefix.kv_fill=abc", "kv_fill='abc' refused")):
        assert bench_main(["--workload", "zipf-prefix", "--workload-param", flag, "--out", str(tmp_path)]) == 2
        assert says in capsys.readouterr().err, flag
