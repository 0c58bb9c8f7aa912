"""Scheduler-level scenarios (GIE's hermetic cases plus prefix affinity), with the default configuration."""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

import pytest

from picker.core.requests import MAX_COUNTED_OUTPUT_TOKENS, ApiKind, InferenceRequest, RequestError
from picker.core.schema import ConfigError
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.prefix.memory import InMemoryPrefixIndex
from picker.routing.decision import Decision
from picker.routing.director import Director, describe_decision
from picker.scheduling.config import (
    DEFAULT_CONFIG,
    STRATEGIES,
    StrategyDeps,
    build_scheduler,
    build_strategy,
    strategy_config,
)
from picker.scheduling.plugins import PeerPick
from picker.scheduling.scheduler import PrefixAwareScheduler
from picker.scheduling.types import Scheduler

SYSTEM = "".join(f"You are a careful assistant. Rule {i}: answer precisely and cite sources. " for i in range(150))


def pods(n: int, **metrics: object) -> list[Endpoint]:
    out = []
    for i in range(n):
        e = Endpoint.from_address(f"10.0.0.{i + 1}:8000")
        e.metrics = EndpointMetrics(updated_at=0.0, **metrics)  # type: ignore[arg-type]
        out.append(e)
    return out


def req(prompt: str, model: str = "llama", **kw: object) -> InferenceRequest:
    return InferenceRequest(request_id="r", model=model, prompt_text=prompt, **kw)  # type: ignore[arg-type]


def route(s: Scheduler, request: InferenceRequest, endpoints: list[Endpoint], now: float = 0.0) -> Endpoint:
    """What the director does: schedule, then on_picked and in-flight accounting on the chosen pod."""
    result = s.schedule(request, endpoints, now)
    chosen = result.ranked[0]
    assert result.context is not None and result.context.request is request
    s.on_picked(result.context, chosen, now)
    chosen.start_request(len(request.prompt_text) // 4, now)
    return chosen


def test_picks_pod_with_lower_queue_and_kv() -> None:
    a, b, c = pods(3)
    a.metrics.waiting, a.metrics.kv_usage = 3, 0.2
    b.metrics.waiting, b.metrics.kv_usage = 0, 0.1
    c.metrics.waiting, c.metrics.kv_usage = 10, 0.2
    s = build_scheduler(rng=random.Random(0))
    for _ in range(20):
        assert s.schedule(req("hello there"), [a, b, c], 0.0).ranked[0] is b


def test_picks_pod_with_lora_loaded_despite_higher_kv() -> None:
    loaded, other = pods(2)
    loaded.metrics = EndpointMetrics(kv_usage=0.6, max_lora=1, running_loras=frozenset({"sql-lora"}))
    other.metrics = EndpointMetrics(kv_usage=0.1, max_lora=1, running_loras=frozenset({"chat-lora"}))
    s = build_scheduler(rng=random.Random(0))
    result = s.schedule(req("SELECT a question", model="sql-lora"), [other, loaded], 0.0)
    assert result.ranked[0] is loaded
    assert {c.endpoint.address: c.scores["lora-affinity-scorer"] for c in result.candidates} == {
        loaded.address: 1.0, other.address: 0.0}


def test_no_endpoints_is_503() -> None:
    with pytest.raises(RequestError) as err:
        build_scheduler().schedule(req("x"), [], 0.0)
    assert err.value.status == 503 and err.value.code == "no_endpoints"


def test_subset_hint_limits_candidates() -> None:
    """The director applies Envoy's subset hint before the scheduler sees any candidate."""
    a, b, c = pods(3)
    pool = EndpointPool()
    pool.set_endpoints([a, b, c])
    director = Director(pool, build_scheduler(rng=random.Random(0)))
    for _ in range(10):
        chosen = director.rank(req("x", subset=(c.address,), api=ApiKind.COMPLETIONS), 0.0)
        assert chosen.ranked == [c] and [x.endpoint for x in chosen.candidates] == [c]
    assert director.rank(req("x", subset=(b.ip,), api=ApiKind.COMPLETIONS), 0.0).ranked == [b]
    for subset in (("10.1.1.1:8000",), ()):
        with pytest.raises(RequestError) as err:
            director.rank(req("x", subset=subset, api=ApiKind.COMPLETIONS), 0.0)
        assert err.value.status == 503 and err.value.code == "no_endpoints" and "subset hint" in err.value.message


@pytest.mark.parametrize("size", [2, 300])  # every pod scored, and a sample of a large pool
def test_any_max_tokens_a_client_asks_for_leaves_routing_working(size: int) -> None:
    """max_tokens is the client's to set (the pod refuses what it cannot serve): counted in flight as asked,
    10**400 overflowed every later load score on that pod."""
    pool = EndpointPool()
    pool.set_endpoints(Endpoint.from_address(f"10.0.{i // 250}.{i % 250 + 1}:8000") for i in range(size))
    director = Director(pool, build_scheduler(rng=random.Random(0)))
    for _ in range(2 * size):
        decision = director.place(req("x" * 300, max_tokens=10**400, api=ApiKind.COMPLETIONS), 0.0)
        assert decision.endpoint in pool.ready()
    assert sum(e.in_flight_tokens for e in pool.ready()) == 2 * size * (300 // 4 + MAX_COUNTED_OUTPUT_TOKENS)


def test_shared_long_prefix_lands_on_one_pod() -> None:
    endpoints = pods(4)
    s = build_scheduler(rng=random.Random(1))
    chosen: Counter[str] = Counter()
    for i in range(30):
        r = req(SYSTEM + f"Question {i}: what is {i} squared?")
        e = route(s, r, endpoints, float(i))
        chosen[e.address] += 1
        e.finish_request(len(r.prompt_text) // 4)  # each finishes before the next: no load builds up
    assert len(chosen) == 1
    result = s.schedule(req(SYSTEM + "Another question"), endpoints, 31.0)
    assert result.profile == "context-heavy"
    assert result.prefix_matched_blocks == len(SYSTEM) // 64 and result.prefix_blocks > result.prefix_matched_blocks


def without_hot_credit(**params: Any) -> dict[str, Any]:
    """The default config with the prefix scorer's hot-prefix credit off (one holder per prefix), and `params`."""
    config = copy.deepcopy(DEFAULT_CONFIG)
    for plugin in config["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin.setdefault("parameters", {}).update(hotShare=None, **params)
    return config


def test_by_default_in_flight_counts_alone_never_move_a_prefix() -> None:
    """A batching engine's in-flight count is not a queue: with nothing waiting, the holder keeps its prefix however
    far ahead it is (docs/decisions.md)."""
    endpoints = pods(4)
    s = build_scheduler(without_hot_credit(), rng=random.Random(2))
    order = [route(s, req(SYSTEM + f"Q{i}"), endpoints, 0.0) for i in range(16)]  # none finish
    assert order == [order[0]] * 16 and order[0].in_flight == 16


def test_popular_prefix_spreads_past_the_in_flight_guard() -> None:
    """With one holder per prefix and `loadGuardInFlight` 8, a prefix all the traffic wants moves only when its
    holder is 8 requests ahead."""
    endpoints = pods(4)
    s = build_scheduler(without_hot_credit(loadGuardInFlight=8), rng=random.Random(2))
    order = [route(s, req(SYSTEM + f"Q{i}"), endpoints, 0.0) for i in range(12)]  # none finish
    first = order[0]
    assert order[:8] == [first] * 8  # prefix affinity holds until `first` is 8 requests ahead
    second = order[8]
    assert second is not first and order[8:] == [second] * 4  # the spill pod now holds the prefix too
    result = s.schedule(req(SYSTEM + "Q-next"), endpoints, 0.0)
    held = {c.endpoint.address: c.scores["prefix-cache-scorer"] for c in result.candidates}
    assert held[first.address] == 0.0 and held[second.address] > 0.5  # guard zeroes the overloaded holder


def test_hot_prefix_gets_holders_by_load_and_a_quiet_one_keeps_its_pod() -> None:
    """A prefix that carries more than a pod's share of the traffic is copied as soon as its holder is clearly the
    busier pod, and its holders then share it by load; the same prefix sent one request at a time, its holder free
    whenever the next arrives, stays on one pod."""
    endpoints = pods(4)
    s = build_scheduler(rng=random.Random(2))
    order = [route(s, req(SYSTEM + f"Q{i}"), endpoints, 0.0) for i in range(12)]  # none finish
    assert order[:2] == [order[0]] * 2 and order[2] is not order[0]  # copied once its holder is 2 ahead
    assert sorted(Counter(e.address for e in order).values()) == [3, 3, 3, 3]  # then shared by load
    for gap in (1.0, 0.0):  # one at a time, each answered before the next (at once: recent prefill work shows)
        quiet = pods(4)
        s = build_scheduler(rng=random.Random(2))
        for i in range(40):
            r = req(SYSTEM + f"Q{i}")
            e = route(s, r, quiet, i * gap)
            e.finish_request(len(r.prompt_text) // 4)
        assert sorted(e.finished for e in quiet) == [0, 0, 0, 40]  # its holder is free each time: no copy


def test_many_prefixes_keep_one_holder_each_under_load() -> None:
    """Twenty prefixes with a twentieth of the traffic each are never hot: each keeps the pod it was dealt to,
    the load scorers notwithstanding, so caches under pressure are not spent on copies."""
    endpoints = pods(2)
    s = build_scheduler(rng=random.Random(4))
    systems = [f"System prompt {g}: " + SYSTEM for g in range(20)]
    rng = random.Random(5)
    homes: dict[int, set[str]] = {}
    flight: list[tuple[Endpoint, int]] = []
    for i in range(400):
        g = rng.randrange(20)
        r = req(systems[g] + f"Q{i}")
        e = route(s, r, endpoints, i * 0.1)
        homes.setdefault(g, set()).add(e.address)
        flight.append((e, len(r.prompt_text) // 4))
        if len(flight) > 3:  # three requests in flight at any time
            done, tokens = flight.pop(0)
            done.finish_request(tokens)
    assert sum(len(h) for h in homes.values()) <= 22  # at most a couple of spills among 20 prefixes


def test_a_pod_that_joins_empty_takes_prefixes_until_no_holder_is_crowded() -> None:
    """A pod that joins while its peer holds every prefix and queues (a restart, a scale-up) gets prefixes copied
    to it, each once, until the traffic is shared; without the per-pod share it would get nothing, the load guard
    being far off at three requests in flight. A pod whose cache is full takes none: a copy there would evict a
    prefix it serves."""

    def run(config: dict[str, Any], joins_full: bool = False) -> tuple[dict[int, set[str]], Counter[str]]:
        a, fresh = pods(2)
        index = InMemoryPrefixIndex()
        if joins_full:
            index.set_capacity(fresh.address, 40)
            index.record(list(range(1, 41)), fresh.address, 0.0)  # another prompt's 40 blocks fill it
        s = build_scheduler(config, rng=random.Random(6), index=index)
        systems = [f"System prompt {g}: " + SYSTEM for g in range(6)]
        rng = random.Random(7)
        flight: list[tuple[Endpoint, int]] = []
        homes: dict[int, set[str]] = {}
        served: Counter[str] = Counter()
        for i in range(400):
            g = rng.randrange(6)
            r = req(systems[g] + f"Q{i}")
            e = route(s, r, [a] if i < 100 else [a, fresh], i * 0.1)  # alone for the first 10 s
            if i >= 200:  # once settled
                homes.setdefault(g, set()).add(e.address)
                served[e.address] += 1
            flight.append((e, len(r.prompt_text) // 4))
            if len(flight) > 3:  # three requests in flight at any time
                done, tokens = flight.pop(0)
                done.finish_request(tokens)
        return homes, served

    homes, served = run(DEFAULT_CONFIG)
    assert len(served) == 2 and min(served.values()) >= 0.3 * sum(served.values())
    assert 1 <= sum(len(h) == 2 for h in homes.values()) < 6  # some prefixes copied, not all
    homes, served = run(DEFAULT_CONFIG, joins_full=True)
    assert len(served) == 1 and all(len(h) == 1 for h in homes.values())
    config = copy.deepcopy(DEFAULT_CONFIG)
    for plugin in config["plugins"]:
        if plugin["type"] == "prefix-cache-scorer":
            plugin["parameters"] = {"crowdedShare": None}
    _, served = run(config)
    assert len(served) == 1  # the pod that joined stays idle


def test_cold_prefixes_spread_evenly_over_idle_pods() -> None:
    endpoints = pods(4)
    s = build_scheduler(rng=random.Random(3))
    counts: Counter[str] = Counter()
    for i in range(40):
        r = req(f"{i:04d} a brand new conversation with nothing in common " * 3)
        e = route(s, r, endpoints, float(i))
        counts[e.address] += 1
        e.finish_request(len(r.prompt_text) // 4)
    assert sorted(counts.values()) == [10, 10, 10, 10]


def test_a_prefix_every_pod_evicted_comes_back_to_its_home() -> None:
    """Once the index has forgotten a prefix on every pod (their caches evicted it), its next request goes back to
    the pod it last went to, not to the next pod in the cold dealing order: elsewhere it would join another pod's
    working set and evict one of its prefixes (docs/decisions.md). A prompt with another opening is dealt."""
    endpoints = pods(4)
    index = InMemoryPrefixIndex(10_000)
    s = build_scheduler(index=index, rng=random.Random(3))

    def served(prompt: str, now: float) -> Endpoint:
        e = route(s, req(prompt), endpoints, now)
        e.finish_request(len(prompt) // 4)
        return e

    home = served(SYSTEM + "first question", 0.0)
    dealt = [served(f"{i:04d} another opening, nothing shared " * 40, 1.0 + i) for i in range(4)]
    assert dealt[-1] is home and home not in dealt[:3]  # dealt round to it last: the next cold prompt goes elsewhere
    for e in endpoints:
        index.remove_endpoint(e.address)  # every pod's cache evicted everything
    result = s.schedule(req(SYSTEM + "a later question"), endpoints, 10.0)
    assert result.context is not None and not result.context.matches and result.context.home == home.address
    assert result.ranked[0] is home
    back = Decision(result.context.request, result.ranked, home.address, result, 0, 10.0)
    assert f"prefix=0/{result.prefix_blocks} blocks home={home.address};" in describe_decision(back, 0.001)
    other = s.schedule(req("9999 a new opening, never seen " * 40), endpoints, 10.0)
    assert other.context is not None and other.context.home is None and other.ranked[0] is not home
    dealt_line = describe_decision(Decision(other.context.request, other.ranked, "x", other, 0, 10.0), 0.001)
    assert "home=" not in dealt_line


def test_a_prefix_goes_home_to_where_another_replica_sent_it() -> None:
    """Replicas share their picks: a prefix one replica sent to a pod, evicted since on every pod, goes back there
    when it reaches another replica (which learned its home from the peer's pick, keys and all), not to the pod
    next in that replica's deal."""
    endpoints = pods(4)
    sender, other = build_scheduler(rng=random.Random(3)), build_scheduler(rng=random.Random(3))
    prompt = SYSTEM + "first question"
    result = sender.schedule(req(prompt), endpoints, 0.0)
    assert result.context is not None
    home = endpoints[2]
    sender.on_picked(result.context, home, 0.0)
    later = other.schedule(req(SYSTEM + "a later question"), endpoints, 10.0)
    assert later.context is not None and later.context.home is None  # not heard: dealt like any cold prompt
    dealt_first = later.ranked[0]
    other.on_peer_picked(PeerPick(home.address, len(prompt) / 4, "", len(prompt), result.context.keys), 0.5)
    back = other.schedule(req(SYSTEM + "a later question"), endpoints, 10.0)
    assert back.context is not None and back.context.home == home.address and back.ranked[0] is home
    assert dealt_first is not home  # the peer's pick changed where it goes


def test_a_replica_that_replayed_the_shared_index_matches_each_pod_on_its_cache() -> None:
    """A replica that starts replays the fleet's picks into its index before it has picked any pod itself; the
    first prompt it matches must see each pod's share bounded by the pod's reported cache, not by the default
    (which kept prefixes the pod had long evicted, and sent that prompt to be prefilled cold)."""
    endpoints = pods(2)
    for e in endpoints:
        e.metrics.block_size, e.metrics.num_gpu_blocks = 16, 20  # 20 index blocks of 64 characters each
    hashing = build_scheduler()  # the replicas' keys (their index apart)

    def keys_of(request: InferenceRequest) -> list[int]:
        result = hashing.schedule(request, endpoints, 0.0)
        assert result.context is not None
        return result.context.keys

    index = InMemoryPrefixIndex()
    s = build_scheduler(index=index, rng=random.Random(3))
    old = req(SYSTEM + "an old question")
    keys = keys_of(old)
    index.record(keys, endpoints[0].address, 0.0)  # replayed: sent there a while ago
    for i in range(8):  # then newer prompts there, three times its cache over
        index.record(keys_of(req(f"{i:04d} a newer prompt " * 20)), endpoints[0].address, 0.1 + i)
    assert index.match(keys, None, 9.0).get(endpoints[0].address)  # the default share still holds it
    result = s.schedule(old, endpoints, 9.0)
    assert result.context is not None and endpoints[0].address not in result.context.matches


def test_random_tie_break_alone_is_uneven() -> None:
    """The spreader matters: without it the same cold traffic lands unevenly (guards the test above)."""
    config = {"schedulingProfiles": [{"name": "p", "plugins": [
        {"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "queue-scorer", "weight": 2},
        {"pluginRef": "max-score-picker"}]}]}
    endpoints = pods(4)
    s = build_scheduler(config, rng=random.Random(3))
    counts = Counter(route(s, req(f"{i:04d} fresh " * 20), endpoints).address for i in range(40))
    assert sorted(counts.values()) != [10, 10, 10, 10]


def test_short_prompts_use_bursty_chat_and_explain_adds_up() -> None:
    endpoints = pods(3)
    endpoints[0].in_flight = 2
    s = build_scheduler(rng=random.Random(4))
    result = s.schedule(req("hi, how are you?", session_id="abc"), endpoints, 0.0)
    assert result.profile == "bursty-chat"
    weights = {"prefix-cache-scorer": 3, "queue-scorer": 1, "kv-cache-utilization-scorer": 1,
               "in-flight-load-scorer": 3, "lora-affinity-scorer": 2, "session-affinity-scorer": 1,
               "cold-prefix-spreader": 4}
    assert len(result.candidates) == 3
    for cand in result.candidates:
        assert set(cand.scores) == set(weights)
        assert all(0.0 <= v <= 1.0 for v in cand.scores.values())
        assert cand.total == pytest.approx(sum(weights[k] * v for k, v in cand.scores.items()))
    assert result.ranked[0] is not endpoints[0]
    assert [c.total for c in result.candidates] == sorted((c.total for c in result.candidates), reverse=True)


def test_session_affinity_keeps_a_conversation_on_its_pod() -> None:
    endpoints = pods(3)
    s = build_scheduler(rng=random.Random(5))
    assert s.context(req("turn one", session_id="chat-1"), endpoints, 0.0).session_pod is None
    first = route(s, req("turn one", session_id="chat-1"), endpoints)
    first.finish_request(2)
    # the cycle state names the session's pod, so the cold-prompt deal steps aside for it
    assert s.context(req("turn two", session_id="chat-1"), endpoints, 0.0).session_pod == first.address
    for turn in range(5):
        chosen = route(s, req(f"unrelated turn {turn}", session_id="chat-1"), endpoints)
        chosen.finish_request(2)
        assert chosen is first



def test_a_conversations_next_turn_stays_with_its_history_under_small_load_differences() -> None:
    """A 1,600-character first turn (600 real tokens) matches 1,536 characters: short of longPrefixChars, but most
    of the next turn, so the turn stays on its pod while that pod has a few more requests in flight."""
    rng = random.Random(7)
    words = ["alpha", "bo", "cider", "delta", "ex", "fox", "gamma", "hi"]
    first_turn = " ".join(rng.choice(words) for _ in range(400))[:1600] + "\nAssistant:"
    next_turn = first_turn + " an answer\n\nUser: " + " ".join(rng.choice(words) for _ in range(40)) + "\nAssistant:"
    for extra in (1, 2, 3, 4):
        endpoints = pods(2)
        s = build_scheduler(rng=random.Random(0))
        holder = route(s, req(first_turn), endpoints)
        for _ in range(extra - 1):
            holder.start_request(400, 0.0)
        result = s.schedule(req(next_turn), endpoints, 5.0)
        assert result.profile == "context-heavy"
        assert result.ranked[0] is holder, extra
    unshared = " ".join(rng.choice(words) for _ in range(800))
    s = build_scheduler(rng=random.Random(0))
    route(s, req(first_turn), pods(2))
    assert s.schedule(req(first_turn[:1100] + unshared), pods(2), 5.0).profile == "bursty-chat"
    # held by both pods (a popular prompt): moving between them is free, so load decides
    endpoints = pods(2)
    s = build_scheduler(rng=random.Random(0))
    first = s.schedule(req(first_turn), endpoints, 0.0)
    assert first.context is not None
    for e in endpoints:
        s.on_picked(first.context, e, 0.0)
    assert s.schedule(req(next_turn), endpoints, 5.0).profile == "bursty-chat"

def test_saturated_pods_are_filtered_unless_all_are() -> None:
    a, b = pods(2)
    a.metrics.waiting = 9
    s = build_scheduler(rng=random.Random(6))
    result = s.schedule(req("x"), [a, b], 0.0)
    assert result.ranked == [b]
    assert [c.filtered_by for c in result.candidates if c.endpoint is a] == ["saturation-filter"]
    b.metrics.kv_usage = 0.95
    assert len(s.schedule(req("x"), [a, b], 0.0).ranked) == 2


def test_endpoint_removal_purges_index_and_capacity_comes_from_metrics() -> None:
    index = InMemoryPrefixIndex()
    s = build_scheduler(rng=random.Random(7), index=index)
    a, b = pods(2)
    a.metrics.num_gpu_blocks = 40
    route(s, req(SYSTEM), [a])
    route(s, req(SYSTEM), [b])
    assert index.capacity(a.address) == 40 and index.endpoint_size(a.address) == 40
    assert index.endpoint_size(b.address) == -(-len(SYSTEM) // 64)
    fixed = build_scheduler({"prefixCache": {"blockChars": 256}}, index=(other := InMemoryPrefixIndex()))
    cpu = pods(1, block_size=128, num_gpu_blocks=10)[0]  # 10 x 128 tokens x 4 chars = 20 blocks of 256 chars
    route(fixed, req(SYSTEM), [cpu])
    assert other.capacity(cpu.address) == 20 and other.endpoint_size(cpu.address) == 20
    s.on_endpoint_removed(b)
    assert index.endpoint_size(b.address) == 0 and index.size() == 40


def test_block_size_follows_the_pods() -> None:
    s = build_scheduler(rng=random.Random(8))
    gpu, cpu = pods(1, block_size=16), pods(1, block_size=128)
    text = "z" * 5000
    assert s.schedule(req(text), gpu, 0.0).prefix_blocks == -(-5000 // 64)
    assert s.schedule(req(text), cpu, 0.0).prefix_blocks == -(-5000 // 512)
    fixed = build_scheduler({"prefixCache": {"blockChars": 100}})
    assert fixed.schedule(req(text), cpu, 0.0).prefix_blocks == 50


def test_model_and_salt_isolate_prefixes() -> None:
    s = build_scheduler(rng=random.Random(9))
    endpoints = pods(4)
    route(s, req(SYSTEM, model="a"), endpoints)
    assert s.schedule(req(SYSTEM, model="a"), endpoints, 0.0).prefix_matched_blocks > 0
    assert s.schedule(req(SYSTEM, model="b"), endpoints, 0.0).prefix_matched_blocks == 0
    assert s.schedule(req(SYSTEM, model="a", cache_salt="t2"), endpoints, 0.0).prefix_matched_blocks == 0


def test_seeded_schedulers_are_reproducible() -> None:
    def run(seed: int) -> list[str]:
        s = build_scheduler(rng=random.Random(seed))
        endpoints = pods(5)
        return [route(s, req(f"{i} " * (i * 40 + 1)), endpoints).address for i in range(30)]

    assert run(11) == run(11)


def baseline(name: str, seed: int = 1, **parameters: Any) -> PrefixAwareScheduler:
    """Strategy `name` as `--strategy` builds it, its one scorer's parameters (config spelling) replaced."""
    scheduler = build_strategy(name, StrategyDeps(rng=random.Random(seed)))
    if parameters:
        cfg = strategy_config(name).model_dump(by_alias=True)
        cfg["plugins"][0]["parameters"] = parameters
        scheduler = build_scheduler(cfg, rng=random.Random(seed))
    return scheduler


def test_baseline_strategies() -> None:
    endpoints = pods(3)
    rr = baseline("round-robin")
    assert [route(rr, req("x"), endpoints).address for _ in range(4)] == [e.address for e in endpoints + endpoints[:1]]
    assert [e.address for e in rr.schedule(req("x"), endpoints, 0.0).ranked] == [e.address for e in
                                                                                 endpoints[1:] + endpoints[:1]]
    rnd = baseline("random")
    assert {route(rnd, req("x"), endpoints).address for _ in range(50)} == {e.address for e in endpoints}
    ll = baseline("least-load")
    a, b, c = pods(3)
    a.metrics.waiting, b.metrics.kv_usage = 2, 0.5
    assert ll.schedule(req("x"), [a, b, c], 0.0).ranked[0] is c
    po = baseline("prefix-only")
    first = route(po, req(SYSTEM + "1"), endpoints)
    assert all(route(po, req(SYSTEM + str(i)), endpoints) is first for i in range(10))  # ignores load
    for name in STRATEGIES:
        s = build_strategy(name, StrategyDeps(rng=random.Random(0)))
        result = s.schedule(req("x"), endpoints, 0.0)
        assert result.ranked and result.profile == (name if name != "picker" else "bursty-chat")
        if name != "picker":  # a baseline's details are its scorers' scores: clamped to [0, 1]
            assert all(0.0 <= x <= 1.0 for c in result.candidates for x in c.details.values())
    assert isinstance(build_strategy("picker"), PrefixAwareScheduler)
    with pytest.raises(ValueError):
        build_strategy("bogus")
    with pytest.raises(RequestError):
        rr.schedule(req("x"), [], 0.0)


def test_a_baseline_keeps_the_configured_prefix_cache_and_runs_its_own_profile() -> None:
    config = {"prefixCache": {"charsPerToken": 3}, "schedulingProfiles": [{"name": "mine", "plugins": []}]}
    cfg = strategy_config("hash-ring", config)
    assert cfg.prefix_cache.chars_per_token == 3
    assert [p.name for p in cfg.scheduling_profiles] == ["hash-ring"]
    assert strategy_config("picker", config).scheduling_profiles[0].name == "mine"


@pytest.mark.parametrize(("name", "parameters", "key"), [
    ("hash-ring", {"virtualNodes": 0}, "virtualNodes"),
    ("bounded-load", {"loadFactor": 0.9}, "loadFactor"),
    ("prefix-hash", {"prefixChars": 0}, "prefixChars"),
    ("text-tree", {"cacheThreshold": 1.5}, "cacheThreshold"),
    ("text-tree", {"balanceRelThreshold": 0.5}, "balanceRelThreshold"),
])
def test_baseline_parameters_are_checked(name: str, parameters: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"scheduling\.plugins\[0\]\.parameters\.{key}"):
        baseline(name, **parameters)


def test_hash_ring_is_sticky_even_and_consistent() -> None:
    """Same first 1,000 characters -> same pod whatever the load; 200 points per pod keep the shares within ~10 %
    of even; a pod leaving moves only its own keys, to the next pod clockwise (its former first fallback)."""
    endpoints = pods(4)
    ring = baseline("hash-ring")
    first = route(ring, req(SYSTEM + "question one"), endpoints)
    first.in_flight = first.metrics.waiting = 50
    assert all(route(ring, req(SYSTEM + f"q{i}"), endpoints) is first for i in range(10))
    prompts = [f"system prompt number {i}. " * 60 for i in range(4000)]
    ranked = {p: ring.schedule(req(p), endpoints, 0.0).ranked for p in prompts}
    share = Counter(r[0].address for r in ranked.values())
    assert len(share) == 4 and max(share.values()) / min(share.values()) < 1.25
    assert all(len({e.address for e in r}) == 3 for r in ranked.values())  # three distinct fallbacks
    gone = endpoints[2]
    rest = [e for e in endpoints if e is not gone]
    for p, r in ranked.items():
        after = ring.schedule(req(p), rest, 0.0).ranked[0]
        assert after is (r[1] if r[0] is gone else r[0])


def test_bounded_load_passes_a_hot_key_on_past_its_bound() -> None:
    """A pod over ceil(1.25 x (in-flight + 1) / pods) passes the key to the next pod on the ring, always the same
    one; under the bound the ring's choice stands."""
    endpoints = pods(4)
    ring, bounded = baseline("hash-ring"), baseline("bounded-load", loadFactor=1.25)
    hot = req(SYSTEM + "hot")
    order = ring.schedule(hot, endpoints, 0.0).ranked
    assert bounded.schedule(hot, endpoints, 0.0).ranked[0] is order[0]
    order[0].in_flight = 2  # bound: ceil(1.25 x 3 / 4) = 1 -> over it
    assert bounded.schedule(hot, endpoints, 0.0).ranked[0] is order[1]
    order[1].in_flight = 2  # bound: ceil(1.25 x 5 / 4) = 2 -> 2 + 1 is over
    assert bounded.schedule(hot, endpoints, 0.0).ranked[0] is order[2]
    for e in endpoints:
        e.in_flight = 3  # everyone at the mean: ceil(1.25 x 13 / 4) = 5, room everywhere -> the ring's choice
    assert bounded.schedule(hot, endpoints, 0.0).ranked[0] is order[0]


def test_text_tree_follows_the_longest_sent_prefix_else_the_pod_sent_least() -> None:
    """SGLang router's cache_aware policy: a prompt sharing over 30 % with text sent to a pod goes there whatever
    its load (until the in-flight counts are out of balance by 64 and 1.5x); a new prefix goes to the pod sent the
    least text, so a pod that joins takes every new prefix and none of the known ones."""
    a, b = pods(2)
    tree = baseline("text-tree")
    first = route(tree, req(SYSTEM + "question one"), [a, b])
    other = b if first is a else a
    assert route(tree, req("another system prompt. " * 40 + "q"), [a, b]) is other  # new: the pod sent less
    assert route(tree, req(SYSTEM[:100] + "x" * 900), [a, b]) is other  # 6 % shared: below the 30 % threshold
    first.in_flight, other.in_flight = 60, 0  # busier, not out of balance (60 - 0 is not over 64)
    assert all(route(tree, req(SYSTEM + f"q{i}"), [a, b]) is first for i in range(3))
    first.in_flight, other.in_flight = 66, 1  # 66 - 1 > 64 and 66 > 1.5 x 1: the idlest takes it
    assert route(tree, req(SYSTEM + "q"), [a, b]) is other
    first.in_flight = other.in_flight = 0
    joined = Endpoint.from_address("10.0.0.9:8000")
    joined.metrics = EndpointMetrics(updated_at=0.0)
    assert route(tree, req(SYSTEM + "q again"), [a, b, joined]) in (a, b)  # known prefix: not the new pod
    assert route(tree, req("a third system prompt. " * 40), [a, b, joined]) is joined  # new prefix: the new pod
    result = tree.schedule(req(SYSTEM + "q"), [a, b, joined], 0.0)
    assert all(0.0 <= s <= 1.0 for c in result.candidates for s in c.details.values())


def test_prefix_hash_is_sticky_spread_and_consistent() -> None:
    """Same first 1,000 characters -> same pod whatever the load; many prefixes spread; a pod leaving moves only
    the prefixes it held (rendezvous hashing)."""
    endpoints = pods(4)
    ph = baseline("prefix-hash", prefixChars=1000)
    first = route(ph, req(SYSTEM + "question one"), endpoints)
    first.metrics.waiting = 50
    assert all(route(ph, req(SYSTEM + f"q{i}"), endpoints) is first for i in range(10))
    prompts = [f"system prompt number {i}. " * 60 for i in range(400)]
    placed = {p: ph.schedule(req(p), endpoints, 0.0).ranked[0] for p in prompts}
    share = Counter(e.address for e in placed.values())
    assert len(share) == 4 and min(share.values()) > 60  # 100 each on average
    gone = endpoints[1]
    rest = [e for e in endpoints if e is not gone]
    for p, e in placed.items():
        after = ph.schedule(req(p), rest, 0.0).ranked[0]
        assert after is e or e is gone
    by_model = [ph.schedule(req(p, model=m), endpoints, 0.0).ranked[0] for p in prompts[:40] for m in ("m1", "m2")]
    assert any(a is not b for a, b in zip(by_model[::2], by_model[1::2], strict=True))  # the model is in the key
    assert len(ph.schedule(req("a"), endpoints, 0.0).ranked) == 3  # max_endpoints


def test_large_pools_sum_in_numpy_with_exact_ties() -> None:
    from picker.scheduling.scheduler import _NUMPY_MIN_CANDIDATES, _weighted_totals

    rng = random.Random(12)
    n = _NUMPY_MIN_CANDIDATES + 50
    columns = [[rng.choice((0.0, 0.1, 1 / 3, 0.7, 1.0)) for _ in range(n)] for _ in range(7)]
    weights = [5.0, 1.0, 1.0, 1.0, 2.0, 1.0, 2.0]
    numpy_totals = _weighted_totals(columns, weights, n)
    small = [_weighted_totals([c[i : i + 1] for c in columns], weights, 1)[0] for i in range(n)]
    assert numpy_totals == small  # bit-identical to the list loop, so equal rows tie exactly

    endpoints = pods(n)
    result = build_scheduler(rng=random.Random(0)).schedule(req("a cold prompt"), endpoints, 0.0)
    assert len({c.total for c in result.candidates}) == 1
    firsts = {build_scheduler(rng=random.Random(seed)).schedule(req("a cold prompt"), endpoints, 0.0).ranked[0].address
              for seed in range(20)}
    assert len(firsts) > 10  # ties among many pods are broken at random


def test_expired_entries_are_swept_by_later_picks() -> None:
    index = InMemoryPrefixIndex(ttl=100.0)
    s = build_scheduler(rng=random.Random(13), index=index)
    a, b = pods(2)
    route(s, req(SYSTEM), [a], now=0.0)
    held = index.size()
    assert held > 0
    route(s, req("short and unrelated"), [b], now=10.0)  # within ttl/4 of the last sweep: nothing swept
    assert index.size() == held + 1
    route(s, req("another unrelated one"), [b], now=150.0)  # a's entries expired and get freed
    assert index.endpoint_size(a.address) == 0 and index.size() == 1  # b: only the fresh prompt


def test_a_peer_replicas_pick_steers_the_next_cold_request_elsewhere() -> None:
    """`on_peer_picked` reaches the stateful plugins: after a peer sent a long prompt to one pod, a cold
    request goes to the other, whichever pod the peer chose."""
    for busy in (0, 1):
        s = build_scheduler(None, rng=random.Random(3))
        endpoints = pods(2)
        s.on_peer_picked(PeerPick(endpoints[busy].address, 4096), 0.0)
        chosen = s.schedule(req("a cold question nobody asked before " * 4), endpoints, 0.001).ranked[0]
        assert chosen is endpoints[1 - busy]
