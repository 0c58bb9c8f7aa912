"""Model rewrites: the model a client names becomes the one a pod serves, optionally split by weight.

The reference picker's InferenceModelRewrite (llm-d.ai/v1alpha2) in the same shape: rules with `matches` (exact
model names; none = every request) and weighted `targets` (`modelRewrite`). Rules come from the config
(`scheduling.models.rewrites`) and from the pool's InferenceModelRewrite objects in Kubernetes; an exact match
wins over a catch-all, then configured rules over discovered ones (oldest object first), then list order. A
request's own `x-gateway-model-name-rewrite` header wins over any rule. The director applies the rule before
routing (so only pods that serve the target are candidates) and the pod gets a body naming the target; the
client sees its own name again in response bodies the picker is shown.
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from pydantic import Field, model_validator

from picker.core.requests import InferenceRequest
from picker.core.schema import Section

MAX_WEIGHT = 1_000_000


class ModelMatchSpec(Section):
    type: Literal["Exact"] = "Exact"
    value: str = Field(min_length=1)


class MatchSpec(Section):
    model: ModelMatchSpec


class TargetSpec(Section):
    model_rewrite: str = Field(min_length=1)
    weight: int | None = Field(None, ge=1, le=MAX_WEIGHT)


class RewriteRuleSpec(Section):
    """One rule as InferenceModelRewrite's `spec.rules[]` has it, plus an optional `name` (the metric label)."""

    name: str | None = None
    matches: list[MatchSpec] = Field(default_factory=list)
    targets: list[TargetSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _weights_all_or_none(self) -> RewriteRuleSpec:
        weighted = sum(t.weight is not None for t in self.targets)
        if 0 < weighted < len(self.targets):
            raise ValueError("targets: give every target a weight, or none (an even split)")
        return self


@dataclass(frozen=True, slots=True)
class RewriteRule:
    name: str  # the rule's (or its InferenceModelRewrite's) name: `model_rewrite_name` in the metrics
    models: frozenset[str]  # the exact names it matches; empty: every request
    targets: tuple[str, ...]
    cumulative: tuple[int, ...]  # running sum of the targets' weights, for a weighted draw

    @classmethod
    def from_spec(cls, spec: RewriteRuleSpec, default_name: str) -> RewriteRule:
        weights = [t.weight or 1 for t in spec.targets]
        return cls(spec.name or default_name, frozenset(m.model.value for m in spec.matches),
                   tuple(t.model_rewrite for t in spec.targets), tuple(accumulate(weights)))

    def choose(self, rng: random.Random) -> str:
        if len(self.targets) == 1:
            return self.targets[0]
        draw = rng.randrange(self.cumulative[-1])
        return self.targets[bisect.bisect_right(self.cumulative, draw)]


def configured_rules(specs: Sequence[RewriteRuleSpec]) -> list[RewriteRule]:
    return [RewriteRule.from_spec(spec, f"config-{i}") for i, spec in enumerate(specs)]


class ModelRewrites:
    """Which rule, if any, rewrites a request's model; configured rules first, discovered ones after."""

    def __init__(self, configured: Iterable[RewriteRule] = (), rng: random.Random | None = None) -> None:
        self.configured = tuple(configured)
        self.rng = rng if rng is not None else random.Random()
        self._index(())

    def set_discovered(self, rules: Sequence[RewriteRule]) -> None:
        """The pool's InferenceModelRewrite rules as Kubernetes has them now (oldest object first)."""
        self._index(rules)

    def _index(self, discovered: Iterable[RewriteRule]) -> None:
        exact: dict[str, RewriteRule] = {}
        generic: RewriteRule | None = None
        for rule in (*self.configured, *discovered):
            for model in rule.models:
                exact.setdefault(model, rule)
            if not rule.models and generic is None:
                generic = rule
        self._exact, self._generic = exact, generic

    def __bool__(self) -> bool:
        return bool(self._exact) or self._generic is not None

    def rule_for(self, model: str) -> RewriteRule | None:
        return self._exact.get(model, self._generic)

    def apply(self, request: InferenceRequest) -> RewriteRule | None:
        """Set the request's target model from its rule (unless its header named one); the rule applied."""
        if request.target_model is not None or not request.model:
            return None
        rule = self.rule_for(request.model)
        if rule is None:
            return None
        request.target_model = rule.choose(self.rng)  # may be the model itself: one side of a split
        request.rewrite_rule = rule.name
        return rule


def body_for_target(body: bytes, target: str) -> bytes:
    """The request body with `model` set to the target (the body parsed as JSON before: it is valid)."""
    data = json.loads(body)
    data["model"] = target
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def response_swaps(target: str, requested: str) -> tuple[tuple[bytes, bytes], ...]:
    """The `"model":"<target>"` bytes a pod's response carries (compact, as vLLM writes JSON, or spaced) and
    what the client should read instead."""
    old, new = json.dumps(target, ensure_ascii=False).encode(), json.dumps(requested, ensure_ascii=False).encode()
    return ((b'"model":' + old, b'"model":' + new), (b'"model": ' + old, b'"model": ' + new))


def swap_models(chunk: bytes, swaps: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """A response chunk with the target model's name put back to the one the client asked for."""
    for old, new in swaps:
        if old in chunk:
            chunk = chunk.replace(old, new)
    return chunk
