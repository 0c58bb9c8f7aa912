"""Fuzzy prefix affinity (MinHash-LSH over a prompt's leading window): similar prompts share bands, the scorer
speaks only when the exact match is empty, and through Envoy a prompt that differs from an earlier one only in its
first line goes where that one went."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest
import yaml

from picker.core.requests import InferenceRequest
from picker.core.schema import ConfigError
from picker.endpoints.state import Endpoint
from picker.scheduling.config import DEFAULT_CONFIG, StrategyDeps, build_strategy
from picker.scheduling.context import SchedulingContext
from picker.scheduling.fuzzy import FuzzyPrefixScorer, MinHasher
from picker_lab.bench.configs import with_scorer
from picker_lab.supervisor import process_scope, start_backends, start_picker_fleet

WORDS = [f"{w}{i}" for i in range(40) for w in ("alpha", "beta", "gamma", "delta", "omega")]


def text(seed: int, words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ctx(prompt: str, matched: list[int]) -> SchedulingContext:
    out = SchedulingContext(request=InferenceRequest(request_id="r", model="m", prompt_text=prompt), now=0.0,
                            model="m")
    out.matched = matched
    return out


def test_near_duplicates_share_bands_and_unrelated_texts_do_not() -> None:
    hasher = MinHasher(bands=8, rows=4, window_chars=2048, shingle_words=4)
    body = text(1)
    same = hasher.band_keys("Request 000001 at 12:00:01\n" + body)
    other = hasher.band_keys("Request 000002 at 12:00:02\n" + body)
    unrelated = hasher.band_keys(text(2))
    assert len(same) == 8 and sum(a == b for a, b in zip(same, other, strict=True)) >= 5
    assert sum(a == b for a, b in zip(same, unrelated, strict=True)) == 0
    assert hasher.band_keys("") == []
    assert hasher.band_keys(body) == MinHasher(8, 4, 2048, 4).band_keys(body)  # the same in every process


def test_the_scorer_points_at_the_pod_of_a_similar_prompt_only_without_an_exact_match() -> None:
    scorer = FuzzyPrefixScorer()
    a, b = Endpoint.from_address("10.0.0.1:8000"), Endpoint.from_address("10.0.0.2:8000")
    body = text(3)
    first = ctx("id 1\n" + body, [0, 0])
    assert scorer.score(first, [a, b]) == [0.0, 0.0]  # nothing remembered yet
    scorer.on_picked(first, b, 0.0)
    similar = ctx("id 2\n" + body, [0, 0])
    low, high = scorer.score(similar, [a, b])
    assert low == 0.0 and 0.8 <= high <= 1.0
    assert scorer.score(ctx("id 3\n" + body, [4, 0]), [a, b]) == [0.0, 0.0]  # exact match found: silent
    assert scorer.score(ctx(text(4), [0, 0]), [a, b]) == [0.0, 0.0]  # unrelated prompt
    scorer.on_endpoint_removed(b)
    assert scorer.score(ctx("id 4\n" + body, [0, 0]), [a, b]) == [0.0, 0.0]


def test_its_parameters_are_decoded_strictly() -> None:
    with pytest.raises(ConfigError, match="band"):
        build_strategy("picker", StrategyDeps(with_scorer(DEFAULT_CONFIG, "fuzzy-prefix-scorer", 2, {"bandz": 4})))
    with pytest.raises(ConfigError, match="rows"):
        build_strategy("picker", StrategyDeps(with_scorer(DEFAULT_CONFIG, "fuzzy-prefix-scorer", 2, {"rows": 0})))
    build_strategy("picker", StrategyDeps(with_scorer(DEFAULT_CONFIG, "fuzzy-prefix-scorer", 2, {"bands": 16})))


def served_by(url: str, prompt: str) -> str:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": "tiny", "prompt": prompt})
                                     .encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.loads(response.read())["served_by"])


@pytest.mark.parametrize("fuzzy", [True, False])
def test_through_envoy_a_prompt_differing_in_its_first_line_follows_the_similar_one(fuzzy: bool) -> None:
    """Two idle pods; prompts share a long body and differ in their first line, so exact prefix matching finds
    nothing. Without the fuzzy scorer the cold-prefix spreader sends the second to the other pod; with it (weight
    10), to the pod the first went to."""
    scheduling = with_scorer(DEFAULT_CONFIG, "fuzzy-prefix-scorer", 10) if fuzzy else DEFAULT_CONFIG
    with process_scope("fuzzy") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses,
                                   flags=["--config-text", yaml.safe_dump({"scheduling": scheduling})])
        started.extend(fleet.processes)
        body = text(5)
        first = served_by(fleet.envoy.url, "ticket 1 opened at 09:00\n" + body)
        second = served_by(fleet.envoy.url, "ticket 2 opened at 09:05\n" + body)
        assert (second == first) is fuzzy, (first, second)
