"""Scorers, filters, picker and config parsing, one signal at a time."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.core.replicas import ReplicaView
from picker.core.requests import InferenceRequest
from picker.core.schema import ConfigError
from picker.endpoints.saturation import SaturationThresholds
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.prefix.hashing import IndexKey
from picker.scheduling.config import DEFAULT_CONFIG, build_scheduler
from picker.scheduling.context import SchedulingContext
from picker.scheduling.filters import SaturationFilter
from picker.scheduling.memory import FadingTally
from picker.scheduling.picker import MaxScorePicker
from picker.scheduling.plugins import PeerPick
from picker.scheduling.scorers import (
    InFlightLoadScorer,
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    PrefixCacheScorer,
    QueueScorer,
    SessionAffinityScorer,
)
from picker.scheduling.spreading import ColdPrefixSpreader


def ep(i: int, **metrics: object) -> Endpoint:
    e = Endpoint.from_address(f"10.0.0.{i}:8000")
    e.metrics = EndpointMetrics(**metrics)  # type: ignore[arg-type]
    return e


def ctx_for(request: InferenceRequest | None = None, *, keys: int = 0, matched: list[int] | None = None,
            block_chars: int = 64) -> SchedulingContext:
    request = request or InferenceRequest("r", "m", prompt_text="x")
    ctx = SchedulingContext(request=request, now=0.0, model=request.target_model or request.model)
    ctx.session = IndexKey().session(request.session_id) if request.session_id else ""  # as the scheduler does
    ctx.keys = list(range(keys))
    ctx.block_chars = block_chars
    ctx.matched = matched or []
    return ctx


def test_replicas_sharing_a_pool_deal_concurrent_cold_prompts_to_different_pods() -> None:
    """The same view (shared scrapes, each other's picks): replica i of n deals its own share of the pods first
    (every n-th in address order from the i-th), so n replicas dealing at once take n different pods, and still do
    when one has heard of a deal the others have not (their rankings then differ by a pod: the rank each took
    before, its i-th best, could be the same pod). Alone, or in a pool too small for it, a replica deals its best."""
    pods = [ep(i) for i in range(1, 9)]
    for i, pod in enumerate(pods):
        pod.in_flight = i % 3  # the same loads every replica sees
    cold = ctx_for(keys=3, matched=[0] * 8)
    order = sorted(range(8), key=lambda i: pods[i].address)

    def best(spreader: ColdPrefixSpreader, candidates: list[Endpoint]) -> int:
        scores = spreader.score(cold, candidates)
        assert all(0.0 <= x <= 1.0 for x in scores)
        return scores.index(max(scores))

    picks = [best(ColdPrefixSpreader(replicas=ReplicaView(i, 4)), pods) for i in range(4)]
    assert len(set(picks)) == 4 and all(order.index(p) % 4 == i for i, p in enumerate(picks))
    for heard in range(4):  # one replica has heard of a deal to the pod every replica ranks best, the others not
        spreaders = [ColdPrefixSpreader(replicas=ReplicaView(i, 4)) for i in range(4)]
        top = best(ColdPrefixSpreader(), pods)
        spreaders[heard].on_peer_picked(PeerPick(pods[top].address, 2000), 0.0)
        assert len({best(s, pods) for s in spreaders}) == 4
    alone = best(ColdPrefixSpreader(), pods)
    assert best(ColdPrefixSpreader(replicas=ReplicaView(0, 1)), pods) == alone
    few = pods[:6]  # fewer than two pods per replica: each deals its best
    assert best(ColdPrefixSpreader(replicas=ReplicaView(3, 4)), few) == best(ColdPrefixSpreader(), few)


def test_prefix_score_blends_ratio_and_absolute_length() -> None:
    scorer = PrefixCacheScorer(load_guard_in_flight=None, load_guard_waiting=None)
    pods = [ep(1), ep(2)]
    short_full = scorer.score(ctx_for(keys=2, matched=[2, 0]), pods)
    long_half = scorer.score(ctx_for(keys=200, matched=[100, 0]), pods)
    assert short_full[1] == 0.0 and long_half[1] == 0.0
    # A fully matched 2-block prompt is worth less than half of a 200-block one.
    assert short_full[0] == pytest.approx(0.5 + 0.5 * 128 / 4096)
    assert long_half[0] == pytest.approx(0.75)
    assert short_full[0] < long_half[0]
    ratio_only = PrefixCacheScorer(ratio_weight=1.0, load_guard_in_flight=None, load_guard_waiting=None)
    assert ratio_only.score(ctx_for(keys=4, matched=[1, 4]), pods) == [0.25, 1.0]
    assert scorer.score(ctx_for(keys=0, matched=[0, 0]), pods) == [0.0, 0.0]


def test_prefix_load_guard_removes_credit_of_an_overloaded_holder() -> None:
    scorer = PrefixCacheScorer(load_guard_in_flight=8, load_guard_waiting=4)
    busy, idle, queued = ep(1), ep(2), ep(3, waiting=6.0)
    busy.in_flight = 8
    scores = scorer.score(ctx_for(keys=10, matched=[10, 10, 10]), [busy, idle, queued])
    assert scores[0] == 0.0 and scores[1] == pytest.approx(0.5 + 0.5 * 640 / 4096) and scores[2] == 0.0
    busy.in_flight = 7
    assert scorer.score(ctx_for(keys=10, matched=[10, 10]), [busy, idle])[0] > 0


def test_kv_and_queue_scores() -> None:
    pods = [ep(1, kv_usage=0.25, waiting=2.0), ep(2, kv_usage=1.5, waiting=6.0), ep(3, kv_usage=-0.1, waiting=4.0)]
    assert KVCacheUtilizationScorer().score(ctx_for(), pods) == [0.75, 0.0, 1.0]
    assert QueueScorer().score(ctx_for(), pods) == [1.0, 0.0, 0.5]
    assert QueueScorer().score(ctx_for(), [ep(1, waiting=3.0), ep(2, waiting=3.0)]) == [1.0, 1.0]


def test_in_flight_scorer_prefers_less_work() -> None:
    a, b, c = ep(1), ep(2), ep(3)
    a.in_flight, b.in_flight, c.in_flight = 0, 1, 4
    c.in_flight_tokens = 8192
    scores = InFlightLoadScorer(tokens_per_request=4096, slack=1.0).score(ctx_for(), [a, b, c])
    assert scores[0] == 1.0 and scores[0] > scores[1] > scores[2] >= 0.0
    assert scores[2] == pytest.approx(1 - 6 / 7)
    assert InFlightLoadScorer(slack=0).score(ctx_for(), [ep(4), ep(5)]) == [1.0, 1.0]


def test_in_flight_scorer_counts_recent_prefill_with_decay() -> None:
    scorer = InFlightLoadScorer(tokens_per_request=4096, slack=1.0, prefill_half_life=0.05, prefill_weight=4)
    a, b = ep(1), ep(2)
    long_prompt = InferenceRequest("r", "m", prompt_text="w" * 4 * 4096)  # ~4096 tokens
    scorer.on_picked(ctx_for(long_prompt), a, 0.0)
    ctx = ctx_for()
    fresh = scorer.score(ctx, [a, b])
    assert fresh[1] == 1.0 and fresh[0] < 0.25, "a pod just handed a long prompt is busy prefilling it"
    ctx.now = 0.5  # ten half-lives later the prefill is done
    later = scorer.score(ctx, [a, b])
    assert later[0] > 0.99
    scorer.on_endpoint_removed(a)
    ctx.now = 0.0
    assert scorer.score(ctx, [a, b]) == [1.0, 1.0]
    # Off by default in the class (on in the shipped config): no memory without a half-life.
    plain = InFlightLoadScorer()
    plain.on_picked(ctx_for(long_prompt), a, 0.0)
    assert plain.score(ctx_for(), [a, b]) == [1.0, 1.0]


def test_lora_affinity_levels() -> None:
    running = ep(1, max_lora=2, running_loras=frozenset({"sql"}))
    room = ep(2, max_lora=2, running_loras=frozenset({"other"}))
    waiting_full = ep(3, max_lora=1, running_loras=frozenset({"other"}), waiting_loras=frozenset({"sql"}))
    full = ep(4, max_lora=1, running_loras=frozenset({"other"}))
    no_lora = ep(5)
    pods = [running, room, waiting_full, full, no_lora]
    adapter_req = InferenceRequest("r", "sql", prompt_text="x")
    assert LoraAffinityScorer().score(ctx_for(adapter_req), pods) == [1.0, 0.8, 0.6, 0.0, 0.0]
    base_req = InferenceRequest("r", "llama", prompt_text="x")
    assert LoraAffinityScorer().score(ctx_for(base_req), pods) == [1.0] * 5  # nobody lists it: base model
    assert LoraAffinityScorer(base_models=["llama"]).score(ctx_for(base_req), pods) == [1.0] * 5
    # A declared adapter nobody has loaded yet: only pods with room can take it.
    new_req = InferenceRequest("r", "fresh", prompt_text="x")
    assert LoraAffinityScorer(adapters=["fresh"]).score(ctx_for(new_req), pods) == [0.8, 0.8, 0.0, 0.0, 0.0]
    # With base models configured, anything else is an adapter.
    assert LoraAffinityScorer(base_models=["llama"]).score(ctx_for(new_req), pods)[3] == 0.0
    rewritten = InferenceRequest("r", "alias", prompt_text="x", target_model="sql")
    assert LoraAffinityScorer().score(ctx_for(rewritten), pods)[0] == 1.0


def test_session_affinity_sticks_bounded_and_forgets_removed() -> None:
    scorer = SessionAffinityScorer(max_sessions=2)
    a, b = ep(1), ep(2)
    req = InferenceRequest("r", "m", prompt_text="x", session_id="s1")
    assert scorer.score(ctx_for(req), [a, b]) == [0.0, 0.0]
    scorer.on_picked(ctx_for(req), b, 0.0)
    assert scorer.score(ctx_for(req), [a, b]) == [0.0, 1.0]
    for s in ("s2", "s3"):
        scorer.on_picked(ctx_for(InferenceRequest("r", "m", session_id=s)), a, 0.0)
    assert len(scorer) == 2 and scorer.score(ctx_for(req), [a, b]) == [0.0, 0.0]  # s1 evicted
    scorer.on_endpoint_removed(a)
    assert len(scorer) == 0
    scorer.on_picked(ctx_for(InferenceRequest("r", "m")), a, 0.0)  # no session id: nothing remembered
    assert len(scorer) == 0


def test_cold_spreader_deals_out_and_stays_neutral_on_hits() -> None:
    spreader = ColdPrefixSpreader()
    pods = [ep(1), ep(2), ep(3)]
    req = InferenceRequest("r", "m", prompt_text="x")
    assert spreader.score(ctx_for(keys=3, matched=[0, 2, 0]), pods) == [0.0, 0.0, 0.0]
    assert spreader.score(ctx_for(keys=3, matched=[0, 0, 0]), pods) == [1.0, 1.0, 1.0]
    spreader.on_picked(ctx_for(req), pods[0], 0.0)
    spreader.on_picked(ctx_for(req), pods[1], 0.0)
    scores = spreader.score(ctx_for(keys=3, matched=[0, 0, 0]), pods)
    assert scores[1] < scores[0] < scores[2]  # least recently chosen first
    pods[2].in_flight = 5  # the never-chosen pod is busy with others' work: load counts too
    scores = spreader.score(ctx_for(keys=3, matched=[0, 0, 0]), pods)
    assert scores[0] > scores[2]
    by_recency = ColdPrefixSpreader(recency_weight=1.0)
    for pod in pods[:2]:
        by_recency.on_picked(ctx_for(req), pod, 0.0)
    scores = by_recency.score(ctx_for(keys=3, matched=[0, 0, 0]), pods)
    assert scores[1] < scores[0] < scores[2]  # ...unless recency alone is asked for
    in_session = ctx_for(keys=3, matched=[0, 0, 0])
    in_session.session_pod = pods[1].address  # the session's pod is a candidate: session affinity decides
    assert spreader.score(in_session, pods) == [0.0, 0.0, 0.0]
    in_session.session_pod = "10.0.0.9:8000"  # its pod is gone: dealt as usual
    assert spreader.score(in_session, pods) == spreader.score(ctx_for(keys=3, matched=[0, 0, 0]), pods)
    coming_back = ctx_for(keys=5, matched=[0, 0, 0])
    coming_back.home = pods[2].address  # a prefix every pod evicted goes home, busy or not (load scorers weigh)
    assert spreader.score(coming_back, pods) == [0.0, 0.0, 0.5]  # half a deal's swing (docs/decisions.md)
    assert ColdPrefixSpreader(home_credit=1.0).score(coming_back, pods) == [0.0, 0.0, 1.0]
    coming_back.matched = [1, 0, 0]
    assert spreader.score(coming_back, pods) == [0.0, 0.0, 0.0]  # somebody holds part of it: neutral
    # every pod holds the same opening (a system prompt all prompts share): the rest is cold wherever it goes, so
    # it is dealt like a new prompt, and the opening's last pod is no home
    coming_back.matched = [1, 1, 1]
    assert spreader.score(coming_back, pods) == spreader.score(ctx_for(keys=5, matched=[0, 0, 0]), pods)
    coming_back.matched = [0, 0]
    assert spreader.score(coming_back, pods[:2]) == spreader.score(ctx_for(keys=5, matched=[0, 0]), pods[:2])


def test_cold_spreader_deals_a_prompt_mostly_cold_wherever_it_goes() -> None:
    """A short opening one pod holds (a system prompt) before a long new question: the prompt is cold on every pod
    past the opening, so it is dealt, away from a busy holder; a prompt the holder has most of is not."""
    pods = [ep(1), ep(2), ep(3)]
    pods[0].in_flight = 3
    ten_blocks = InferenceRequest("r", "m", prompt_text="x" * 64 * 10)
    mostly_cold = ctx_for(ten_blocks, keys=10, matched=[2, 0, 0])  # the holder has a fifth of it
    scores = ColdPrefixSpreader().score(mostly_cold, pods)
    assert scores[0] < scores[1] == scores[2] == 1.0
    assert ColdPrefixSpreader(stand_aside_share=0.0).score(mostly_cold, pods) == [0.0, 0.0, 0.0]  # stands aside
    mostly_held = ctx_for(ten_blocks, keys=10, matched=[3, 0, 0])  # 30 %: the prefix scorer decides
    assert ColdPrefixSpreader().score(mostly_held, pods) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="standAsideShare"):
        ColdPrefixSpreader(stand_aside_share=1.5)


def test_cold_spreader_sees_a_queue_its_counts_do_not() -> None:
    """A pod whose last scrape shows requests waiting (other replicas', or ones our counts missed) is not dealt a
    cold prompt before an idle one; a queue smaller than our own count there changes nothing (docs/decisions.md,
    22)."""
    spreader = ColdPrefixSpreader()
    pods = [ep(1, waiting=4.0), ep(2), ep(3, waiting=3.0)]
    fresh = ctx_for(keys=3, matched=[0, 0, 0])
    scores = spreader.score(fresh, pods)
    assert scores[1] > scores[2] > scores[0]
    spreader.on_picked(ctx_for(), pods[1], 0.0)  # its turn is over, and still the only pod without a queue
    scores = spreader.score(fresh, pods)
    assert scores[1] > scores[2] > scores[0]
    counted = [ep(1, waiting=1.0), ep(2)]
    counted[0].in_flight = counted[1].in_flight = 2  # the queued request is one of ours: already counted
    scores = ColdPrefixSpreader().score(fresh, counted)
    assert scores[0] == scores[1]


def test_cold_spreader_counts_the_uncached_prefill_it_dealt() -> None:
    """A pod dealt a long cold prompt is busy prefilling it for a while: the next cold prompt goes elsewhere even
    where recency alone would send it there, while a short prompt's prefill, or a prompt the pod had cached, barely
    counts, and the work fades (docs/decisions.md)."""
    spreader = ColdPrefixSpreader()  # the defaults: 128 tokens weigh as a request, half-life 0.2 s
    by_count = ColdPrefixSpreader(work_tokens=0)
    pods = [ep(1), ep(2), ep(3)]
    cold = ctx_for(InferenceRequest("r", "m", prompt_text="a" * 8000), keys=125, block_chars=64)
    short = ctx_for(InferenceRequest("r", "m", prompt_text="b" * 100), keys=1, block_chars=64)
    for dealer in (spreader, by_count):
        dealer.on_picked(cold, pods[0], 0.0)  # ~2,000 uncached tokens
        dealer.on_picked(short, pods[1], 0.0)
        dealer.on_picked(short, pods[2], 0.0)
    for pod, tokens in zip(pods, (2000, 25, 25), strict=True):
        pod.start_request(tokens, 0.0)  # the director counts them in flight
    fresh = ctx_for(keys=3, matched=[0, 0, 0])
    assert max(by_count.score(fresh, pods)) == by_count.score(fresh, pods)[0]  # chosen least recently...
    scores = spreader.score(fresh, pods)
    assert scores[0] < scores[1]  # ...but still prefilling: the next in the deal goes first
    # a short prefill weighs next to nothing
    assert scores[1:] == pytest.approx(by_count.score(fresh, pods)[1:], abs=0.05)
    later = ctx_for(keys=3, matched=[0, 0, 0])
    later.now = 5.0  # long since prefilled: recency deals again
    scores = spreader.score(later, pods)
    assert scores[0] > scores[1] > scores[2]
    for pod, tokens in zip(pods, (2000, 25, 25), strict=True):
        pod.finish_request(tokens)

    def work_after(picked: SchedulingContext, pod: Endpoint) -> list[float]:
        spreader.on_picked(picked, pod, 5.0)
        pod.start_request(2000, 5.0)
        probe = ctx_for(keys=3, matched=[0, 0, 0])
        probe.now = 5.0
        spreader.score(probe, pods)
        assert probe.details is not None
        return [d.explain()["work_tokens"] for d in probe.details[spreader.name]]

    warm = ctx_for(InferenceRequest("r", "m", prompt_text="a" * 8000), keys=125, block_chars=64)
    warm.matches = {pods[1].address: 125}  # the pod had all of it cached: no prefill dealt
    assert work_after(warm, pods[1]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-3)
    assert work_after(cold, pods[0])[0] == pytest.approx(2000.0)  # the same prompt cold: ~2,000 tokens dealt
    pods[0].finish_request(2000)  # answered: its pod is done with it
    probe = ctx_for(keys=3, matched=[0, 0, 0])
    probe.now = 5.0
    spreader.score(probe, pods)
    assert probe.details is not None and probe.details[spreader.name][0].explain()["work_tokens"] == 0.0
    spreader.on_endpoint_removed(pods[0])
    with pytest.raises(ValueError):
        ColdPrefixSpreader(work_tokens=-1)


def test_a_fading_tally_halves_every_half_life() -> None:
    tally = FadingTally(0.5)
    assert not tally and tally.value("a", 0.0) == 0.0
    tally.add("a", 100.0, 0.0)
    assert tally.value("a", 0.5) == pytest.approx(50.0) and tally.value("a", 1.0) == pytest.approx(25.0)
    tally.add("a", 100.0, -0.25)  # a peer's pick a moment older than the last: added as of the last
    assert tally.entries["a"] == (200.0, 0.0)
    tally.forget("a")
    assert not tally and tally.value("a", 1.0) == 0.0
    with pytest.raises(ValueError):
        FadingTally(0.0)


def test_saturation_filter_keeps_all_when_all_saturated() -> None:
    f = SaturationFilter(thresholds=SaturationThresholds(queue=5, kv_cache=0.8, stale=0.2))
    ok, queued, full = ep(1, waiting=5.0, kv_usage=0.8), ep(2, waiting=6.0), ep(3, kv_usage=0.9)
    for e in (ok, queued, full):
        e.metrics.updated_at = 0.0
    assert f.filter(ctx_for(), [ok, queued, full]) == [ok]  # at the threshold is full, not past it: kept
    assert f.filter(ctx_for(), [queued, full]) == [queued, full]
    queued.metrics.updated_at = -1.0  # never scraped: its numbers mean nothing, it is not dropped for them
    assert f.filter(ctx_for(), [ok, queued, full]) == [ok, queued]


def test_max_score_picker_ranks_and_breaks_ties_at_random() -> None:
    picker = MaxScorePicker(max_endpoints=3, rng=random.Random(7))
    assert picker.pick([0.1, 0.9, 0.5, 0.7]) == [1, 3, 2]
    assert picker.pick([1.0]) == [0]
    firsts = Counter(picker.pick([2.0, 2.0, 2.0, 1.0])[0] for _ in range(600))
    assert set(firsts) == {0, 1, 2} and min(firsts.values()) > 150
    ranked = picker.pick([2.0, 2.0, 1.0, 1.0, 1.0])
    assert set(ranked[:2]) == {0, 1} and ranked[2] in (2, 3, 4)
    same = [MaxScorePicker(rng=random.Random(3)).pick([1.0] * 10) for _ in range(2)]
    assert same[0] == same[1]


def test_config_errors_are_reported_with_the_key_path() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"plugins": [{"type": "nope"}]}, r"^scheduling\.plugins\[0\]\.type: unknown plugin type 'nope'"),
        ({"plugins": [{"type": "queue-scorer", "parameters": {"bogus": 1}}]},
         r"^scheduling\.plugins\[0\]\.parameters\.bogus: unknown key"),
        ({"schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "missing"}]}]},
         r"^scheduling\.schedulingProfiles\[0\]\.plugins\[0\]\.pluginRef: unknown plugin 'missing'"),
        ({"plugins": [{"type": "prefix-cache-scorer", "parameters": {"ratioWeight": 2}}]},
         r"^scheduling\.plugins\[0\]\.parameters\.ratioWeight: "),
        ({"schedulingprofiles": []}, r"^scheduling\.schedulingprofiles: unknown key"),
        ({"prefixCache": {"ttl": 60}}, r"^scheduling\.prefixCache\.ttl: unknown key"),
        ({"prefixCache": {"ttlSeconds": "soon"}}, r"^scheduling\.prefixCache\.ttlSeconds: "),
        ({"explain": "perhaps"}, r"^scheduling\.explain: "),
        ({"plugins": [{"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": "x"}}]},
         r"^scheduling\.plugins\[0\]\.parameters\.maxNumOfEndpoints: "),
        ({"schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "queue-scorer", "wieght": 2}]}]},
         r"^scheduling\.schedulingProfiles\[0\]\.plugins\[0\]\.wieght: unknown key"),
        ({"kind": "Deployment"}, r"^scheduling\.kind: "),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_scheduler(config)


def test_config_from_yaml_single_profile(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(
        "prefixCache: {blockChars: 32, maxPrefixBlocksToMatch: 4}\n"
        "plugins:\n"
        "  - {type: queue-scorer, name: q}\n"
        "  - {type: max-score-picker, name: p, parameters: {maxNumOfEndpoints: 1}}\n"
        "schedulingProfiles:\n"
        "  - {name: only, plugins: [{pluginRef: q, weight: 2}, {pluginRef: p}]}\n"
    )
    scheduler = build_scheduler(yaml.safe_load(path.read_text()), rng=random.Random(1))
    pods = [ep(1, waiting=3.0), ep(2, waiting=1.0)]
    result = scheduler.schedule(InferenceRequest("r", "m", prompt_text="y" * 1000), pods, 0.0)
    assert result.profile == "only" and result.ranked == [pods[1]]
    assert result.candidates[0].scores == {"q": 1.0} and result.candidates[0].total == 2.0
    assert scheduler.uses_prefix is False and result.prefix_blocks == 0  # no prefix plugin: no hashing
    assert DEFAULT_CONFIG["prefixCache"]["maxPrefixBlocksToMatch"] == 256  # defaults untouched by merging


def test_peer_picks_teach_the_stateful_scorers_like_own_picks() -> None:
    """Replicas sharing the prefix index hear of each other's picks (PeerPick) so they do not herd."""
    a, b = ep(1), ep(2)
    cold = ctx_for(keys=3, matched=[0, 0])
    spreader = ColdPrefixSpreader()
    spreader.on_peer_picked(PeerPick(a.address, 100), 0.0)
    first = spreader.score(cold, [a, b])
    assert first[1] > first[0]
    spreader.on_peer_picked(PeerPick(b.address, 100), 0.0)
    second = spreader.score(cold, [a, b])
    assert second[0] > second[1]

    sticky = SessionAffinityScorer()
    sticky.on_peer_picked(PeerPick(b.address, 100, IndexKey().session("s1")), 0.0)  # ids travel as their MAC
    sticky.on_peer_picked(PeerPick(a.address, 100, ""), 0.0)  # no session: nothing to remember
    assert sticky.score(ctx_for(InferenceRequest("r", "m", prompt_text="x", session_id="s1")), [a, b]) == [0.0, 1.0]
    assert len(sticky) == 1

    load = InFlightLoadScorer(prefill_half_life=0.05, prefill_weight=4)
    load.on_peer_picked(PeerPick(a.address, 4096), 0.0)
    assert load.score(ctx_for(), [a, b])[0] < 0.25  # a peer just handed `a` a long prompt
    load.on_peer_picked(PeerPick(a.address, 4096), -0.01)  # a peer's pick may be a moment older: adds up
    b.in_flight = 1  # one request with no prompt against 2 x 4096 recent tokens at weight 4: 8 requests on `a`
    assert load.score(ctx_for(), [a, b]) == pytest.approx([1.0 - 7 / 8, 1.0])  # (8 - 1) / (8 - 1 + slack 1)
