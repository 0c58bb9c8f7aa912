"""Prefill/decode disaggregation in the scheduler: roles from labels, the decode pick first, a prefill pick when the
prompt's uncached part reaches the threshold, decode-only otherwise, and the reference's config keys."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from picker.core.requests import ApiKind, InferenceRequest
from picker.core.schema import ConfigError
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint
from picker.routing import plugins as request_plugins
from picker.routing.director import Director
from picker.routing.lifecycle import PluginDeps
from picker.scheduling.config import build_scheduler
from picker.scheduling.disagg import DecodeFilter, PrefillFilter, PrefixBasedPdDecider
from tests.test_scorers import ctx_for

ROLE = "llm-d.ai/role"

PD: dict[str, Any] = {
    "plugins": [
        {"type": "prefix-cache-scorer"}, {"type": "queue-scorer"}, {"type": "prefill-filter"},
        {"type": "decode-filter"}, {"type": "max-score-picker"},
        {"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}}},
        {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 64}},
    ],
    "schedulingProfiles": [
        {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "prefix-cache-scorer",
                                                                          "weight": 2}, {"pluginRef": "queue-scorer"}]},
        {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, {"pluginRef": "prefix-cache-scorer",
                                                                        "weight": 2}, {"pluginRef": "queue-scorer"}]},
    ],
}


def pod(i: int, role: str | None) -> Endpoint:
    return Endpoint.from_address(f"10.0.2.{i}:8000", labels={ROLE: role} if role else {})


def request(chars: int, text: str = "a") -> InferenceRequest:
    return InferenceRequest(f"r{chars}{text}", "m", api=ApiKind.COMPLETIONS, prompt_text=(text * chars)[:chars])


def test_roles_decide_who_prefills_and_who_decodes() -> None:
    pods = [pod(1, "prefill"), pod(2, "decode"), pod(3, "prefill-decode"), pod(4, "both"), pod(5, None),
            pod(6, "encode")]
    assert [e.labels.get(ROLE) for e in PrefillFilter().filter(ctx_for(), pods)] == ["prefill", "prefill-decode",
                                                                                     "both"]
    assert [e.labels.get(ROLE) for e in DecodeFilter().filter(ctx_for(), pods)] == ["decode", "prefill-decode",
                                                                                    "both", None]


def test_the_prefix_decider_counts_the_tokens_the_decode_pod_lacks() -> None:
    decider = PrefixBasedPdDecider(non_cached_tokens=100)
    decode = pod(2, "decode")
    ctx = ctx_for(request(800), block_chars=64)  # 200 tokens, none cached
    assert decider.disaggregate(ctx, decode)
    ctx.matches = {decode.address: 8}  # 512 chars = 128 tokens held: 72 left, under 100
    assert not decider.disaggregate(ctx, decode)
    assert not decider.disaggregate(ctx_for(request(360)), decode)  # 90 tokens in all
    assert not PrefixBasedPdDecider(non_cached_tokens=0).disaggregate(ctx_for(request(8000)), decode)  # 0: never
    gated = PrefixBasedPdDecider(non_cached_tokens=10, prompt_tokens=500)
    assert not gated.disaggregate(ctx_for(request(800)), decode)  # a prompt under promptTokens stays local
    tokenized = request(40)
    tokenized.token_ids = list(range(300))  # token ids, when known, count rather than characters
    assert decider.disaggregate(ctx_for(tokenized), decode)


def test_a_long_uncached_prompt_is_prefilled_on_a_prefill_pod_and_decoded_on_a_decode_pod() -> None:
    scheduler = build_scheduler(PD, rng=random.Random(1))
    pods = [pod(1, "prefill"), pod(2, "decode"), pod(3, "decode")]
    long = scheduler.schedule(request(2000), pods, 0.0)
    assert long.ranked[0].labels[ROLE] == "decode" and long.profile == "decode"
    assert long.prefill is pods[0]
    assert long.disaggregation is not None and long.disaggregation.decision_type == "prefill-decode"
    assert (long.disaggregation.plugin_name, long.disaggregation.plugin_type) == ("disagg-profile-handler",) * 2
    short = scheduler.schedule(request(100), pods, 0.0)  # 25 tokens: under nonCachedTokens
    assert short.prefill is None and short.disaggregation is not None
    assert short.disaggregation.decision_type == "decode-only"


def test_a_prompt_the_decode_pod_holds_stays_there_and_both_pods_learn_a_prefill() -> None:
    scheduler = build_scheduler(PD, rng=random.Random(1))
    pods = [pod(1, "prefill"), pod(2, "decode")]
    first = scheduler.schedule(request(2000, "b"), pods, 0.0)
    assert first.prefill is pods[0] and first.context is not None
    scheduler.on_picked(first.context, first.ranked[0], 0.0)
    held = scheduler.index.match(first.context.keys, None, 1.0)
    assert held == {pods[0].address: len(first.context.keys), pods[1].address: len(first.context.keys)}
    again = scheduler.schedule(request(2000, "b"), pods, 1.0)  # the decode pod holds it now: nothing to move
    assert again.ranked[0] is pods[1] and again.prefill is None


def test_no_prefill_pod_means_decode_only_and_no_decode_pod_is_an_error() -> None:
    scheduler = build_scheduler(PD)
    result = scheduler.schedule(request(2000), [pod(2, "decode"), pod(3, None)], 0.0)
    assert result.prefill is None and result.disaggregation is not None
    assert result.disaggregation.decision_type == "decode-only"
    with pytest.raises(Exception, match="filtered out"):
        scheduler.schedule(request(2000), [pod(1, "prefill")], 0.0)


def test_a_pool_without_a_pd_handler_decides_nothing() -> None:
    assert build_scheduler(PD).may_disaggregate and not build_scheduler().may_disaggregate
    decode_only = copy.deepcopy(PD)
    decode_only["plugins"][5] = {"type": "disagg-profile-handler"}  # no prefill decider: never a second pod
    assert not build_scheduler(decode_only).may_disaggregate
    result = build_scheduler().schedule(request(2000), [pod(1, "prefill"), pod(2, "decode")], 0.0)
    assert result.disaggregation is None and result.prefill is None


def test_the_deprecated_handler_and_flat_keys_work() -> None:
    config = copy.deepcopy(PD)
    config["plugins"][5] = {"type": "pd-profile-handler", "parameters": {"decodeProfile": "decode",
                                                                          "prefillProfile": "prefill"}}
    result = build_scheduler(config).schedule(request(2000), [pod(1, "prefill"), pod(2, "decode")], 0.0)
    assert result.disaggregation is not None and result.disaggregation.plugin_type == "pd-profile-handler"
    assert result.prefill is not None
    config["plugins"][5] = {"type": "disagg-profile-handler", "parameters": {
        "prefillDeciderPluginName": "always", "decodeProfile": "decode"}}
    config["plugins"].append({"type": "always-disagg-pd-decider", "name": "always"})
    assert build_scheduler(config).schedule(request(10), [pod(1, "prefill"), pod(2, "decode")], 0.0).prefill \
        is not None


@pytest.mark.parametrize("handler,message", [
    ({"deciders": {"prefill": "nobody"}}, r"plugins\[5\]\.parameters: unknown prefill decider 'nobody'"),
    ({"deciders": {"prefill": "queue-scorer"}}, r"plugins\[5\]\.parameters: 'queue-scorer' is not a prefill"),
    ({"deciders": {"prefill": "prefix-based-pd-decider"}, "profiles": {"prefill": "fill"}},
     r"plugins\[5\]\.parameters: runs unknown profile 'fill'"),
    ({"deciders": {"prefill": "prefix-based-pd-decider"}, "decodeProfile": "decode"}, "not both"),
    ({"deciders": {"encode": "e"}}, r"deciders\.encode: .*encode disaggregation is not implemented"),
    ({"stageOrder": "prefill-first"}, r"stageOrder"),
])
def test_bad_pd_handler_settings_name_the_key(handler: dict[str, Any], message: str) -> None:
    config = copy.deepcopy(PD)
    config["plugins"][5]["parameters"] = handler
    with pytest.raises(ConfigError, match=message):
        build_scheduler(config)


def test_the_director_counts_the_prefill_pod_busy_until_the_response_begins() -> None:
    pods = [pod(1, "prefill"), pod(2, "decode")]
    pool = EndpointPool()
    pool.set_endpoints(pods)
    for e in pods:
        pool.mark_ready(e)
    scheduler = build_scheduler(PD)
    director = Director(pool, scheduler, plugins=request_plugins.build(PluginDeps(scheduler, lambda: 0.0)))
    decision = director.place(request(2000), 0.0)
    prefill = pool.get(pods[0].address)
    assert decision.prefill is prefill and prefill is not None and prefill.in_flight == 1
    assert decision.endpoint.address == pods[1].address and decision.endpoint.in_flight == 1
    director.response_started(decision)
    assert prefill.in_flight == 0 and decision.endpoint.in_flight == 1
    director.release(decision)
    assert prefill.in_flight == 0 and decision.endpoint.in_flight == 0


def test_a_backlogged_prefill_pod_is_passed_over_for_a_local_prefill() -> None:
    pods = [pod(1, "prefill"), pod(2, "decode")]
    pods[0].in_flight_tokens = 8192  # prompt tokens we sent it that are still prefilling
    scheduler = build_scheduler(PD)
    result = scheduler.schedule(request(2000), pods, 0.0)
    assert result.prefill is None and result.disaggregation is not None
    assert result.disaggregation.decision_type == "decode-only"
    assert result.context is not None
    scheduler.on_picked(result.context, result.ranked[0], 0.0)  # only the pod that computed it learns the prompt
    assert set(scheduler.index.match(result.context.keys, None, 0.0)) == {pods[1].address}
    unlimited = copy.deepcopy(PD)
    unlimited["plugins"][5]["parameters"]["maxPrefillQueueTokens"] = None
    assert build_scheduler(unlimited).schedule(request(2000), pods, 0.0).prefill is pods[0]
    pods[0].in_flight_tokens = 8191
    assert build_scheduler(PD).schedule(request(2000), pods, 0.0).prefill is pods[0]
