"""Model rewrites: which rule applies (exact over catch-all, configured over discovered, oldest object first),
weighted splits, strict decoding of the config, the body the pod gets, the name the client reads back, and the
director routing a rewritten request only to pods serving its target."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from picker.core.model_rewrite import (
    ModelRewrites,
    RewriteRule,
    RewriteRuleSpec,
    body_for_target,
    configured_rules,
    response_swaps,
    swap_models,
)
from picker.core.requests import InferenceRequest, build_request
from picker.core.schema import ConfigError
from picker.endpoints.kube.objects import model_rewrite_rules
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.routing import plugins as request_plugins
from picker.routing.director import Director
from picker.routing.lifecycle import PluginDeps
from picker.scheduling.config import build_scheduler, scheduling_config


def rules(*specs: dict[str, Any]) -> list[RewriteRule]:
    return configured_rules([RewriteRuleSpec.model_validate(s) for s in specs])


def rule(models: list[str], *targets: str, name: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"matches": [{"model": {"value": m}} for m in models],
                            "targets": [{"modelRewrite": t} for t in targets]}
    if name:
        spec["name"] = name
    return spec


def target_of(rewrites: ModelRewrites, model: str, header: str | None = None) -> str | None:
    request = InferenceRequest("r", model, target_model=header)
    rewrites.apply(request)
    return request.target_model


def test_an_exact_match_wins_over_a_catch_all_and_configured_over_discovered() -> None:
    rewrites = ModelRewrites(rules(rule([], "fallback"), rule(["llama"], "llama-v2", name="mine")))
    rewrites.set_discovered(rules(rule(["llama"], "from-k8s"), rule(["qwen"], "qwen-v3"), rule([], "k8s-any")))
    assert target_of(rewrites, "llama") == "llama-v2"  # exact, configured
    assert target_of(rewrites, "qwen") == "qwen-v3"  # exact, discovered: beats the configured catch-all
    assert target_of(rewrites, "mistral") == "fallback"  # no exact rule: the first catch-all
    assert target_of(rewrites, "llama", header="pinned") == "pinned"  # the request's own header wins
    request = InferenceRequest("r", "llama")
    rewrites.apply(request)
    assert request.rewrite_rule == "mine"
    assert not ModelRewrites() and target_of(ModelRewrites(), "llama") is None


def test_a_weighted_split_follows_its_weights_and_unweighted_targets_split_evenly() -> None:
    weighted = ModelRewrites(rules({"targets": [{"modelRewrite": "a", "weight": 9}, {"modelRewrite": "b",
                                                                                        "weight": 1}]}),
                             rng=random.Random(1))
    counts = Counter(target_of(weighted, "m") for _ in range(10_000))
    assert 8_850 <= counts["a"] <= 9_150 and counts["a"] + counts["b"] == 10_000  # 9,000 +- 5 sd
    even = ModelRewrites(rules(rule([], "a", "b", "c")), rng=random.Random(2))
    counts = Counter(target_of(even, "m") for _ in range(9_000))
    assert all(2_800 <= counts[t] <= 3_200 for t in "abc")


@pytest.mark.parametrize(("rewrites", "key"), [
    ([{"targets": [{"modelRewrite": "a", "weight": 2}, {"modelRewrite": "b"}]}], "models.rewrites.0"),
    ([{"targets": []}], "models.rewrites.0.targets"),
    ([{"targets": [{"modelRewrite": "a", "weight": 0}]}], "models.rewrites.0.targets.0.weight"),
    ([{"matches": [{"model": {"value": "x", "type": "Prefix"}}], "targets": [{"modelRewrite": "a"}]}],
     "models.rewrites.0.matches.0.model.type"),
    ([{"targets": [{"model": "a"}]}], "models.rewrites.0.targets.0"),
])
def test_bad_rewrite_config_names_its_key(rewrites: list[dict[str, Any]], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        scheduling_config({"models": {"rewrites": rewrites}})
    assert key in str(err.value).replace("[", ".").replace("]", "")


def test_the_pod_gets_the_target_and_the_client_reads_its_own_name() -> None:
    body = json.dumps({"model": "llama", "prompt": "héllo", "stream": True}).encode()
    assert json.loads(body_for_target(body, "llama-v2")) == {"model": "llama-v2", "prompt": "héllo", "stream": True}
    swaps = response_swaps("llama-v2", "llama")
    assert swap_models(b'{"id":"x","model":"llama-v2","choices":[]}', swaps) == b'{"id":"x","model":"llama","choices":[]}'
    assert swap_models(b'data: {"model": "llama-v2"}', swaps) == b'data: {"model": "llama"}'
    untouched = b'{"model":"llama-v20"}'  # another model whose name starts the same
    assert swap_models(untouched, swaps) is untouched


def test_kubernetes_rules_are_ours_oldest_first_and_a_bad_one_is_skipped() -> None:
    def rewrite(pool: str, created: str, *spec_rules: Any) -> dict[str, Any]:
        return {"metadata": {"creationTimestamp": created}, "spec": {"poolRef": {"name": pool},
                                                                      "rules": list(spec_rules)}}

    objects = {
        "newer": rewrite("llama", "2026-03-01T00:00:00Z", rule(["llama"], "newer-target")),
        "older": rewrite("llama", "2026-01-01T00:00:00Z", rule(["llama"], "older-target"),
                         {"targets": [{"modelRewrite": "a", "weight": -1}]}, rule([], "older-any")),
        "elsewhere": rewrite("mistral", "2025-01-01T00:00:00Z", rule([], "not-ours")),
        "odd": {"spec": "nothing"},
    }
    found = model_rewrite_rules(objects, "llama")
    assert [(r.name, r.targets) for r in found] == [("older", ("older-target",)), ("older", ("older-any",)),
                                                    ("newer", ("newer-target",))]
    rewrites = ModelRewrites()
    rewrites.set_discovered(found)
    assert target_of(rewrites, "llama") == "older-target"


def test_the_director_routes_a_rewritten_request_to_pods_serving_its_target() -> None:
    pool = EndpointPool()
    pods = [Endpoint.from_address(f"10.0.0.{i}:8000") for i in (1, 2)]
    for pod, model in zip(pods, ("llama-v1", "llama-v2"), strict=True):
        pod.metrics = EndpointMetrics(models=frozenset({model}), updated_at=0.0)
    pool.set_endpoints(pods)
    scheduler = build_scheduler()
    rewrites = ModelRewrites(rules(rule(["llama"], "llama-v2")))
    director = Director(pool, scheduler, clock=lambda: 0.0,
                        plugins=request_plugins.build(PluginDeps(scheduler, lambda: 0.0, rewrites)))
    for i in range(10):
        request = build_request({":path": "/v1/completions", ":method": "POST"},
                                json.dumps({"model": "llama", "prompt": f"p{i}"}).encode(), request_id=str(i))
        hold, candidates = director.begin(request, lambda: True)
        assert hold is None  # no admission: placed now
        decision = director.place(request, 0.0, candidates=candidates)
        assert decision.endpoint is pods[1] and request.target_model == "llama-v2"
