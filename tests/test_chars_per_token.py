"""Characters per token learned from the pods' prompt-token counters, and the index capacity that follows it."""

from __future__ import annotations

import pytest

from picker.core.replicas import ReplicaView
from picker.core.requests import InferenceRequest
from picker.endpoints.metrics import parse_metrics
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.prefix.chars_per_token import CharsPerToken
from picker.prefix.memory import InMemoryPrefixIndex
from picker.scheduling.config import build_scheduler
from picker.scheduling.producers import ApproximatePrefix


def pod(address: str = "10.0.0.1:8000", tokens: float = 0.0, count: float = 0.0) -> Endpoint:
    e = Endpoint.from_address(address)
    e.metrics = EndpointMetrics(prompt_tokens=tokens, prompt_count=count, block_size=16, num_gpu_blocks=1000)
    return e


def serve(learner: CharsPerToken, e: Endpoint, n: int, chars: int, tokens: int) -> None:
    """`n` prompts of `chars` characters sent to `e`, which then reports them finished at `tokens` tokens each."""
    for _ in range(n):
        learner.picked(e, chars)
    e.metrics.prompt_tokens += n * tokens
    e.metrics.prompt_count += n


def test_the_estimate_follows_what_the_pods_count() -> None:
    learner = CharsPerToken(4.0, min_requests=4, smoothing=1.0)
    e = pod(tokens=500.0, count=3.0)  # counters from before the picker's time: only what happens after counts
    learner.picked(e, 270)  # the first sight sets the baseline
    serve(learner, e, 8, 270, 100)
    learner.picked(e, 270)  # the next pick sees the scraped counters: 8 finished at 100 tokens, 270 chars each
    assert learner.value == pytest.approx(2.7, rel=0.02) and learner.samples == 1


def test_replicas_each_sending_part_of_the_traffic_read_the_same_ratio() -> None:
    """Per request, not totals: a pod that finished four times what this replica sent still gives 2.7."""
    learner = CharsPerToken(4.0, min_requests=4, smoothing=1.0)
    e = pod()
    learner.picked(e, 270)
    for _ in range(8):
        learner.picked(e, 270)
    e.metrics.prompt_tokens += 32 * 100
    e.metrics.prompt_count += 32
    learner.picked(e, 270)
    assert learner.value == pytest.approx(2.7, rel=0.02)


def test_other_replicas_picks_count_with_ours() -> None:
    """Picks heard from the other replicas fill the same tally: a replica sending a quarter of a pod's traffic
    takes its sample after the pod's first few requests, not after sixteen of its own."""
    learner = CharsPerToken(4.0, min_requests=4, smoothing=1.0)
    e = pod()
    learner.picked(e, 270)
    learner.peer_picked(e.address, 270)
    learner.peer_picked(e.address, 270)
    learner.peer_picked("10.0.0.9:8000", 270)  # a pod we never sent to: nothing to count against
    e.metrics.prompt_tokens += 4 * 100
    e.metrics.prompt_count += 4
    learner.picked(e, 270)
    assert learner.samples == 1 and learner.value == pytest.approx(2.7, rel=0.02)


def test_a_replica_that_just_started_routes_on_the_other_replicas_figure_until_it_has_its_own() -> None:
    replicas = ReplicaView()
    learner = CharsPerToken(4.0, min_requests=4, smoothing=0.5, replicas=replicas)
    learner.follow_peers()
    assert learner.value == 4.0  # no other replica reports one: the configured guess
    replicas.heard([2.6, 2.8, 3.5])
    learner.follow_peers()
    assert learner.value == 2.8 and replicas.chars_per_token is None  # theirs, not reported back as ours
    e = pod()
    learner.picked(e, 200)
    serve(learner, e, 8, 200, 100)
    learner.picked(e, 200)  # its own sample (2.0) moves it from the fleet's figure, and is reported
    assert learner.value == pytest.approx(2.4) and replicas.chars_per_token == pytest.approx(2.4)
    replicas.heard([3.5])
    learner.follow_peers()
    assert learner.value == pytest.approx(2.4)  # once it has learned, its own


def test_a_replica_that_just_started_sizes_each_pod_at_the_other_replicas_figure() -> None:
    """The index shares a replica matches its first prompts on are sized at what the fleet learned (2 characters
    per token: half the configured 4's blocks), not at the configured guess."""
    replicas = ReplicaView()
    replicas.heard([2.0])
    scheduler = build_scheduler(replicas=replicas)
    e = pod()
    scheduler.schedule(InferenceRequest(request_id="r", model="m", prompt_text="x" * 200), [e], 0.0)
    index = scheduler.index
    assert isinstance(index, InMemoryPrefixIndex) and index.capacity(e.address) == 500


def test_no_counters_or_a_reset_leave_the_configured_value() -> None:
    learner = CharsPerToken(4.0, min_requests=2, smoothing=1.0)
    silent = pod()  # an engine without the histogram: its counters stay at zero
    for _ in range(50):
        learner.picked(silent, 300)
    assert learner.value == 4.0 and learner.samples == 0
    e = pod("10.0.0.2:8000", tokens=10_000.0, count=100.0)
    learner.picked(e, 300)
    e.metrics = EndpointMetrics(prompt_tokens=50.0, prompt_count=1.0)  # restarted: counters went back
    for _ in range(5):
        learner.picked(e, 300)
    assert learner.samples == 0
    with pytest.raises(ValueError):
        CharsPerToken(0.0)


def test_the_metric_parser_reads_the_prompt_token_histogram() -> None:
    text = ('vllm:request_prompt_tokens_sum{engine="0",model_name="tiny"} 71.0\n'
            'vllm:request_prompt_tokens_count{engine="0",model_name="tiny"} 4.0\n')
    m = parse_metrics(text)
    assert (m.prompt_tokens, m.prompt_count) == (71.0, 4.0)


def test_index_capacity_follows_the_learned_ratio() -> None:
    """1,000 blocks of 16 tokens at 4 chars per token is 1,000 index blocks of 64 characters; at 2 it is half."""
    scheduler = build_scheduler()
    e = pod()
    e.metrics.block_size = 16
    (approximate,) = [p for p in scheduler.producers if isinstance(p, ApproximatePrefix)]
    learner = approximate.chars_per_token
    learner.smoothing, learner.min_requests = 1.0, 4

    def route(text: str) -> None:
        result = scheduler.schedule(InferenceRequest(request_id="r", model="m", prompt_text=text), [e], 0.0)
        assert result.context is not None
        scheduler.on_picked(result.context, e, 0.0)

    index = scheduler.index
    assert isinstance(index, InMemoryPrefixIndex)
    route("x" * 200)
    assert index.capacity(e.address) == 1000
    for _ in range(8):
        route("y" * 200)
    e.metrics.prompt_tokens += 8 * 100  # 200 characters were 100 tokens each
    e.metrics.prompt_count += 8
    route("z" * 200)
    assert learner.value == pytest.approx(2.0)
    route("w" * 200)  # matched on the share the new ratio gives, not the old one
    assert index.capacity(e.address) == 500
