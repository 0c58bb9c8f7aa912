"""The predicted-TTFT scorer: cost in seconds of waiting, uncached prefill and decode interference; the rate it
learns from vLLM's own prefill counters; the configuration that selects it."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from prometheus_client import generate_latest

import picker.api  # noqa: F401 - says how to build the stubs when they are missing
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.core.requests import InferenceRequest
from picker.core.schema import ConfigError
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.scheduling.config import build_scheduler
from picker.scheduling.context import SchedulingContext
from picker.scheduling.predicted import PredictedTTFTScorer, Prediction
from picker.serving.metrics import PickerMetrics
from picker_lab.bench.configs import PREDICTED_TTFT_CONFIG, predicted_ttft_scheduling
from picker_lab.supervisor import process_scope, start_envoy, start_picker, start_sim
from tests.test_scheduling_grpc import Scene, running_scene
from tests.waiting import eventually_async

RATE = 10_000.0  # prefill tokens per second (the prior's slope)
FIXED = 0.005  # seconds any prefill costs (the prior's intercept)


def pod(i: int, waiting: float = 0.0, running: float = 0.0) -> Endpoint:
    e = Endpoint.from_address(f"10.0.0.{i}:8000")
    e.metrics = EndpointMetrics(waiting=waiting, running=running, updated_at=0.0)
    return e


def ctx(prompt_tokens: int, matched_blocks: list[int], now: float = 0.0, block_tokens: int = 16,
        addresses: list[str] | None = None) -> SchedulingContext:
    """A request of `prompt_tokens` tokens (4 characters each) whose prefix the index places as given."""
    request = InferenceRequest("r", "m", prompt_text="x" * (prompt_tokens * 4))
    c = SchedulingContext(request=request, now=now, model="m")
    c.block_chars = block_tokens * 4
    c.keys = list(range(prompt_tokens // block_tokens))
    c.matched = matched_blocks
    if addresses is not None:
        c.matches = {a: b for a, b in zip(addresses, matched_blocks, strict=True) if b}
    return c


def cost(tokens: float) -> float:
    return FIXED + tokens / RATE


def send(s: PredictedTTFTScorer, request: SchedulingContext, endpoint: Endpoint) -> None:
    """The director's part of a pick: the request counts in flight on the pod, then the scorer hears of it."""
    endpoint.start_request(0, request.now)
    s.on_picked(request, endpoint, request.now)


def scorer(decode_tokens: float = 0.0, queued_request_tokens: float = 1024.0, rate_smoothing: float = 0.2,
           min_rate_sample_tokens: float = 256.0, fixed: float = FIXED) -> PredictedTTFTScorer:
    return PredictedTTFTScorer(prefill_tokens_per_second=RATE, prefill_fixed_seconds=fixed,
                               decode_tokens=decode_tokens, queued_request_tokens=queued_request_tokens,
                               rate_smoothing=rate_smoothing, min_rate_sample_tokens=min_rate_sample_tokens)


def test_prediction_is_wait_plus_an_affine_prefill_plus_decode() -> None:
    s = scorer(decode_tokens=8.0)
    holder, idle = pod(1, running=2), pod(2)
    predicted = s.predict(ctx(2048, [96, 0]), [holder, idle])  # holder has 96 x 16 = 1536 of 2048 tokens
    assert predicted[0].uncached_tokens == pytest.approx(512) and predicted[0].decode_s == pytest.approx(16 / RATE)
    assert predicted[0].prefill_s == pytest.approx(cost(512))
    assert predicted[0].seconds == pytest.approx(cost(512) + 16 / RATE)
    assert predicted[1].seconds == pytest.approx(cost(2048))
    scores = s.score(ctx(2048, [96, 0]), [holder, idle])
    assert scores[0] == 1.0 and scores[1] == pytest.approx((cost(512) + 16 / RATE) / cost(2048))  # in [0, 1]
    assert predicted[0].explain()["predicted_ms"] == pytest.approx(predicted[0].seconds * 1e3)


def test_a_cached_prefix_behind_a_queue_loses_to_a_cold_idle_pod_when_the_wait_costs_more() -> None:
    """Spilling is decided by cost: the holder's backlog against the idle pod's uncached prefill."""
    s = scorer(fixed=0.0)
    holder, idle = pod(1), pod(2)
    addresses = [holder.address, idle.address]
    request = ctx(2048, [120, 0], addresses=addresses)  # 1920 of 2048 tokens cached on the holder
    assert s.score(request, [holder, idle])[0] == 1.0
    send(s, ctx(1000, [0, 0], addresses=addresses), holder)  # 1,000 tokens of work queued on it
    assert s.score(ctx(2048, [120, 0], addresses=addresses), [holder, idle])[0] == 1.0  # 1128 < 2048: wait
    send(s, ctx(1500, [0, 0], addresses=addresses), holder)  # 2,500 queued: more than a cold prefill
    late = s.score(ctx(2048, [120, 0], addresses=addresses), [holder, idle])
    assert late[1] == 1.0 and late[0] < 1.0
    drained = s.score(ctx(2048, [120, 0], now=0.2, addresses=addresses), [holder, idle])  # 2,000 tokens done
    assert drained[0] == 1.0
    holder.finish_request(0)
    holder.finish_request(0)  # both answered: their prefills are done, however fast the pod was
    assert s.predict(ctx(2048, [120, 0], now=0.01, addresses=addresses), [holder, idle])[0].wait_s == 0.0


def test_two_short_prompts_a_moment_apart_go_to_different_pods() -> None:
    """The fixed part of a prefill: a pod just handed a short prompt is busy for an engine step, which a cost per
    token alone would price at almost nothing (and pile short prompts onto one pod)."""
    s = scorer()
    a, b = pod(1), pod(2)
    addresses = [a.address, b.address]
    send(s, ctx(50, [0, 0], addresses=addresses), a)
    predicted = s.predict(ctx(50, [0, 0], now=0.001), [a, b])
    assert predicted[0].wait_s == pytest.approx(cost(50) - 0.001) and predicted[1].wait_s == 0.0
    assert s.score(ctx(50, [0, 0], now=0.001), [a, b]) == [pytest.approx(cost(50) / (2 * cost(50) - 0.001)), 1.0]


def test_cold_tokens_on_a_full_cache_are_priced_for_what_they_evict() -> None:
    """A pod whose cache we have filled evicts a cached token for every one a cold prefill writes, and a later
    request pays to prefill those again: on a full pod the uncached part costs (1 + evictionCost) times as much."""
    s = PredictedTTFTScorer(prefill_tokens_per_second=RATE, prefill_fixed_seconds=FIXED, eviction_cost=2.0)
    fresh, filled = pod(1), pod(2)
    for e in (fresh, filled):
        e.metrics.num_gpu_blocks, e.metrics.block_size = 10, 16  # 160 tokens of KV cache
    send(s, ctx(80, [0, 0], addresses=[fresh.address, filled.address]), filled)  # half full
    half = s.predict(ctx(100, [0, 0], now=1.0), [fresh, filled])
    assert half[0].prefill_s == pytest.approx(cost(100))
    assert half[1].prefill_s == pytest.approx(cost(100) + 2.0 * 0.5 * 100 / RATE)
    send(s, ctx(400, [0, 0], now=1.0, addresses=[fresh.address, filled.address]), filled)  # more than it holds
    full = s.predict(ctx(100, [6, 6], now=2.0), [fresh, filled])  # 96 of 100 tokens cached on both
    assert full[1].prefill_s == pytest.approx(cost(4) + 2.0 * 4 / RATE)  # a warm request evicts little
    assert s.predict(ctx(100, [0, 0], now=2.0), [fresh, filled])[1].prefill_s == pytest.approx(3 * 100 / RATE + FIXED)


def test_a_reported_queue_longer_than_what_we_routed_counts() -> None:
    """Traffic from elsewhere: the pod's waiting requests, each worth a prefill of the mean uncached prompt."""
    s = scorer(queued_request_tokens=500.0)
    busy, idle = pod(1, waiting=4), pod(2)
    predicted = s.predict(ctx(100, [0, 0]), [busy, idle])
    assert predicted[0].wait_s == pytest.approx(4 * cost(500)) and predicted[1].wait_s == 0.0


def window(e: Endpoint, at: float, count: float, tokens: float, seconds: float) -> None:
    e.metrics = EndpointMetrics(updated_at=at, prefill_count=count, prefill_tokens=tokens, prefill_seconds=seconds)


def test_the_cost_is_fitted_to_the_pods_prefill_counters() -> None:
    s = scorer(rate_smoothing=0.1, min_rate_sample_tokens=100.0)
    a, b = pod(1), pod(2)
    s.predict(ctx(100, [0, 0]), [a, b])  # first read: the baselines
    # The pods' truth: 20 ms per prefill + 50 us per token. Windows of short and long prompts, from both pods.
    count = tokens = seconds = 0.0
    for i in range(1, 200):
        n, x = 4.0, (100.0 if i % 2 else 2000.0)
        count, tokens, seconds = count + n, tokens + n * x, seconds + n * (0.020 + 50e-6 * x)
        window(a if i % 3 else b, float(i), count, tokens, seconds)
        s.predict(ctx(100, [0, 0]), [a, b])
    fit = s.pool_cost
    assert fit.fixed == pytest.approx(0.020, rel=0.05) and fit.per_token == pytest.approx(50e-6, rel=0.05)


def test_alike_windows_leave_the_slope_near_its_prior_and_small_ones_wait() -> None:
    s = scorer(rate_smoothing=0.5, min_rate_sample_tokens=100.0)
    e = pod(1)
    s.predict(ctx(100, [0]), [e])
    window(e, 1.0, 10, 10 * 60, 10 * 0.012)  # ten 60-token prefills of 12 ms: the same x every time
    s.predict(ctx(100, [0]), [e])
    window(e, 2.0, 20, 20 * 60, 20 * 0.012)
    s.predict(ctx(100, [0]), [e])
    fit = s.pool_cost
    assert fit.seconds(60) == pytest.approx(0.012, rel=0.05)  # the data's point is met
    assert fit.per_token == pytest.approx(1 / RATE, rel=0.3)  # the slope stays near the prior's
    window(e, 3.0, 21, 20 * 60 + 50, 20 * 0.012 + 0.5)  # 50 tokens: too small a sample, kept for later
    s.predict(ctx(100, [0]), [e])
    assert s.pool_cost.seconds(60) == pytest.approx(0.012, rel=0.05)
    window(e, 4.0, 1, 30, 0.01)  # the pod restarted: counters went back, a new baseline
    s.predict(ctx(100, [0]), [e])
    assert s.pool_cost.seconds(60) == pytest.approx(0.012, rel=0.05)


def test_peer_picks_queue_work_and_removal_forgets_the_pod() -> None:
    from picker.scheduling.plugins import PeerPick

    s = scorer()
    a, b = pod(1), pod(2)
    s.on_peer_picked(PeerPick(a.address, 4000), 0.0)
    assert s.predict(ctx(100, [0, 0]), [a, b])[0].wait_s == pytest.approx(cost(4000))
    s.on_endpoint_removed(a)
    assert s.predict(ctx(100, [0, 0]), [a, b])[0].wait_s == 0.0
    s.on_peer_picked(PeerPick(b.address, 100), 0.0)  # a peer's request: not in our in-flight count, still waited on
    assert s.predict(ctx(100, [0, 0], now=0.001), [a, b])[1].wait_s == pytest.approx(cost(100) - 0.001)


def test_the_documented_config_builds_and_routes_to_the_least_predicted() -> None:
    scheduler = build_scheduler(PREDICTED_TTFT_CONFIG, rng=random.Random(0))
    assert list(scheduler.profiles) == ["predicted-ttft"]
    a, b = pod(1, waiting=3), pod(2)
    result = scheduler.schedule(InferenceRequest("r", "m", prompt_text="hello " * 200), [a, b], 0.0)
    assert result.ranked[0] is b
    scores = {c.endpoint.address: c.scores["predicted-ttft-scorer"] for c in result.candidates}
    assert scores[b.address] == 1.0 and 0.0 <= scores[a.address] < 1.0
    details = {c.endpoint.address: c.details for c in result.candidates}
    # 3 queued, each a prefill of the prior's 1,024 tokens at the priors' cost (7.5 ms + 1,024 / 25,000 s)
    assert details[a.address]["predicted-ttft-scorer.wait_ms"] == pytest.approx(3 * (7.5 + 1024 / 25))
    assert details[b.address]["predicted-ttft-scorer.predicted_ms"] < details[a.address][
        "predicted-ttft-scorer.predicted_ms"]
    with pytest.raises(ConfigError, match=r"parameters\.decodeTokenz: unknown key"):
        build_scheduler({**PREDICTED_TTFT_CONFIG, "plugins": [
            {"type": "predicted-ttft-scorer", "parameters": {"decodeTokenz": 1}}]})


# --- through Envoy: `picker serve` with PREDICTED_TTFT_CONFIG in front of echo pods reporting chosen metrics ---

@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    config = yaml.safe_dump({"refresh-metrics-interval": "50ms",
                             "admission": {"staleThreshold": "2s", "objectives": {"batch": -1}},
                             "scheduling": PREDICTED_TTFT_CONFIG})
    with running_scene("predicted-ttft", config) as started:
        yield started


async def _explain(scene: Scene, body: dict[str, Any]) -> picker_pb2.ExplainResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scene.picker.grpc_port}") as channel:
        return await picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
            path="/v1/completions", body=json.dumps(body).encode()))


async def _via_envoy(scene: Scene, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    async with aiohttp.ClientSession() as session, session.post(scene.envoy.url + "/v1/completions",
                                                                json=body, headers=headers or {}) as response:
        assert response.status == 200, await response.text()
        return str((await response.json())["served_by"])


async def test_through_envoy_a_prefix_stays_until_its_pods_queue_costs_more_than_a_cold_prefill(scene: Scene) -> None:
    document = " ".join(f"clause{i} of the shared contract" for i in range(220))  # ~7,000 chars, ~1,750 tokens
    await scene.set()
    holder = await _via_envoy(scene, {"model": "tiny", "prompt": document + " question 0", "max_tokens": 4})
    for i in range(1, 4):
        assert await _via_envoy(scene, {"model": "tiny", "prompt": document + f" question {i}",
                                        "max_tokens": 4}) == holder
    index = scene.pods.addresses.index(holder)
    asked = {"model": "tiny", "prompt": document + " question 9", "max_tokens": 4}
    explained = await _explain(scene, asked)
    parts = {c.address: c.details for c in explained.candidates}
    assert explained.ranked[0] == holder
    assert all(f"predicted-ttft-scorer.{k}" in parts[a] for a in parts
               for k in ("predicted_ms", "wait_ms", "uncached_tokens", "prefill_ms", "decode_ms"))
    assert parts[holder]["predicted-ttft-scorer.uncached_tokens"] < min(
        d["predicted-ttft-scorer.uncached_tokens"] for a, d in parts.items() if a != holder)
    await scene.set(**{f"p{index}": {"waiting": 1}})  # one request queued: still cheaper than a cold prefill
    assert await _via_envoy(scene, {**asked, "prompt": document + " question 10"}) == holder
    await scene.set(**{f"p{index}": {"waiting": 40}})  # a long queue from traffic elsewhere: spill
    moved = await _via_envoy(scene, {**asked, "prompt": document + " question 11"})
    assert moved != holder
    await scene.set()


@pytest.fixture(scope="module")
def copying() -> Iterator[Scene]:
    """PREDICTED_TTFT_CONFIG whose demand lasts minutes (so the test's pace does not matter), floor 2."""
    config = predicted_ttft_scheduling(demandWindowSeconds=600, demandFloor=2)
    with running_scene("predicted-ttft-copy", yaml.safe_dump({"refresh-metrics-interval": "50ms",
                                                               "scheduling": config})) as started:
        yield started


async def test_through_envoy_a_prefix_many_requests_want_is_copied_when_its_pod_queues(copying: Scene) -> None:
    """The same queue on the holder: kept while the prefix has had 4 requests, copied to another pod once it has had
    12 (each then pays a fifth of the copy)."""
    document = " ".join(f"article{i} of the shared handbook" for i in range(220))
    asked = {"model": "tiny", "max_tokens": 4}
    await copying.set()
    holder = await _via_envoy(copying, {**asked, "prompt": document + " question 0"})
    for i in range(1, 3):
        assert await _via_envoy(copying, {**asked, "prompt": document + f" question {i}"}) == holder
    index = copying.pods.addresses.index(holder)
    await copying.set(**{f"p{index}": {"waiting": 1}})
    assert await _via_envoy(copying, {**asked, "prompt": document + " question 3"}) == holder  # 4 picks: wait
    await copying.set()
    for i in range(4, 12):
        assert await _via_envoy(copying, {**asked, "prompt": document + f" question {i}"}) == holder
    await copying.set(**{f"p{index}": {"waiting": 1}})
    explained = await _explain(copying, {**asked, "prompt": document + " question 12"})
    shares = {c.address: c.details["predicted-ttft-scorer.copy_share"] for c in explained.candidates}
    assert shares[holder] == 1.0 and all(0.0 < v < 0.5 for a, v in shares.items() if a != holder)
    assert await _via_envoy(copying, {**asked, "prompt": document + " question 12"}) != holder  # copied
    await copying.set()


def test_the_readme_yaml_is_the_documented_config() -> None:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "scheduling.md").read_text()
    block = readme.split("  scheduling:          # PREDICTED_TTFT_CONFIG\n", 1)[1].split("  ```", 1)[0]
    assert yaml.safe_load(block) == PREDICTED_TTFT_CONFIG


class Recorder:
    """A PredictionObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float, float]] = []

    def observe_prediction(self, endpoint: Endpoint, predicted_s: float, observed_s: float) -> None:
        self.seen.append((endpoint.address, predicted_s, observed_s))


def test_predictions_are_compared_with_the_ttft_the_pod_measured() -> None:
    recorder = Recorder()
    s = PredictedTTFTScorer(prefill_tokens_per_second=RATE, prefill_fixed_seconds=0.0, decode_tokens=0.0,
                            observer=recorder)
    e = pod(1)
    s.predict(ctx(100, [0]), [e])  # the pod's first scrape: the baseline of its TTFT counters
    send(s, ctx(1000, [0], addresses=[e.address]), e)  # predicted 0.1 s (1,000 cold tokens, idle pod)
    send(s, ctx(1000, [0], addresses=[e.address]), e)  # 0.2 s: behind the first one
    e.metrics = EndpointMetrics(updated_at=1.0, ttft_seconds=0.5, ttft_count=2)  # the pod measured 0.25 s each
    s.predict(ctx(100, [0]), [e])
    assert recorder.seen == [(e.address, pytest.approx(0.15), pytest.approx(0.25))]
    e.metrics = EndpointMetrics(updated_at=2.0, ttft_seconds=0.5, ttft_count=2)  # nothing new: nothing said
    s.predict(ctx(100, [0]), [e])
    assert len(recorder.seen) == 1


def test_the_metrics_show_prediction_against_measurement_and_forget_a_departed_pod() -> None:
    metrics = PickerMetrics("pool")
    e = pod(1)
    metrics.scheduling.observe_prediction(e, 0.15, 0.25)
    text = generate_latest(metrics.registry).decode()
    assert f'picker_ttft_predicted_seconds{{model_server_pod="{e.name}",name="pool"}} 0.15' in text
    assert f'picker_ttft_observed_seconds{{model_server_pod="{e.name}",name="pool"}} 0.25' in text
    assert 'picker_ttft_prediction_ratio_bucket{le="0.67",name="pool"} 1.0' in text
    metrics.forget_pod(e)
    assert "picker_ttft_predicted_seconds{" not in generate_latest(metrics.registry).decode()


async def test_through_envoy_on_simulated_vllm_the_predictions_are_exported_next_to_the_measurements() -> None:
    """picker sim pods export vLLM's TTFT and prefill histograms; `picker serve` with PREDICTED_TTFT_CONFIG
    learns the prefill rate from them and exports prediction against measurement per pod."""
    with process_scope("predicted-ttft-sim") as (logdir, started):
        pods = start_sim(2, logdir, model="tiny", time_scale=10.0)
        started.append(pods.process)
        config = logdir / "picker.yaml"
        config.write_text(yaml.safe_dump({"refresh-metrics-interval": "100ms", "scheduling": PREDICTED_TTFT_CONFIG}))
        picker = start_picker(logdir, endpoints=pods.addresses, extra=["--config-file", str(config)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pods.addresses)
        started.append(envoy.process)
        shared = " ".join(f"policy{i} applies to every answer" for i in range(150))
        async with aiohttp.ClientSession() as session:

            async def exported() -> bool:
                for i in range(4):
                    body = {"model": "tiny", "prompt": f"{shared} question {i}", "max_tokens": 2}
                    async with session.post(envoy.url + "/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
                async with session.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as response:
                    text = await response.text()
                return "picker_ttft_observed_seconds{" in text and "picker_ttft_prediction_ratio_count" in text

            await eventually_async(exported, "predicted and measured TTFT exported", within=30.0)


def test_a_ttft_objective_makes_every_pod_that_meets_it_equal_and_says_when_none_does() -> None:
    s = scorer()
    holder, idle = pod(1), pod(2)
    addresses = [holder.address, idle.address]
    send(s, ctx(3000, [0, 0], addresses=addresses), holder)  # 0.305 s of work queued on the holder
    request = ctx(2048, [120, 0], addresses=addresses)  # holder: 0.305 + 0.0178 s, idle: 0.2098 s
    request.request.slo_ttft_s = 0.5
    assert s.score(request, [holder, idle]) == [1.0, 1.0] and request.slo_attainable is True
    request = ctx(2048, [120, 0], addresses=addresses)
    request.request.slo_ttft_s = 0.25  # only the idle pod makes it
    assert s.score(request, [holder, idle])[1] == 1.0 and s.score(request, [holder, idle])[0] < 0.5
    request = ctx(2048, [120, 0], addresses=addresses)
    request.request.slo_ttft_s = 0.01  # nobody: fastest first, and the director may shed it
    scores = s.score(request, [holder, idle])
    assert scores[1] == 0.5 and scores[0] < scores[1] and request.slo_attainable is False


@pytest.mark.parametrize("value", ["fast", "0", "-5", "inf", "nan"])
def test_a_bad_ttft_objective_is_the_clients_400(value: str) -> None:
    from picker.core.requests import RequestError, build_request

    headers = {":path": "/v1/completions", ":method": "POST", "x-slo-ttft-ms": value}
    with pytest.raises(RequestError) as err:
        build_request(headers, b'{"model": "m", "prompt": "x"}', request_id="r")
    assert err.value.status == 400 and err.value.code == "invalid_header"
    headers["x-slo-ttft-ms"] = "250"
    assert build_request(headers, b'{"model": "m", "prompt": "x"}', request_id="r").slo_ttft_s == 0.25


async def test_through_envoy_a_ttft_objective_keeps_the_cache_and_sheds_only_sheddable_requests(
        scene: Scene) -> None:
    document = " ".join(f"section{i} of the handbook" for i in range(250))
    await scene.set()
    holder = await _via_envoy(scene, {"model": "tiny", "prompt": document + " q0", "max_tokens": 4})
    generous = {"x-slo-ttft-ms": "60000"}  # every pod meets it: the prefix tie-break keeps the cache
    assert await _via_envoy(scene, {"model": "tiny", "prompt": document + " q1", "max_tokens": 4}, generous) == holder
    impossible = {"x-slo-ttft-ms": "0.001"}
    await _via_envoy(scene, {"model": "tiny", "prompt": document + " q2", "max_tokens": 4}, impossible)  # standard
    async with aiohttp.ClientSession() as session, session.post(
            scene.envoy.url + "/v1/completions", json={"model": "tiny", "prompt": document + " q3", "max_tokens": 4},
            headers={**impossible, "x-gateway-inference-objective": "batch"}) as response:
        assert response.status == 429 and (await response.json())["error"]["code"] == "slo_unattainable"
        assert response.headers["retry-after"] == "1"
    async with aiohttp.ClientSession() as session, session.post(
            scene.envoy.url + "/v1/completions", json={"model": "tiny", "prompt": "x"},
            headers={"x-slo-ttft-ms": "soon"}) as response:
        assert response.status == 400 and (await response.json())["error"]["code"] == "invalid_header"


def test_the_benchmarks_config_file_is_the_documented_config_and_serve_accepts_it(tmp_path: Path) -> None:
    """`picker bench` (live and real-engine) runs picker-predicted-ttft from this file."""
    import argparse

    from picker.serving.config import add_arguments, resolve
    from picker_lab.bench.live import predicted_ttft_config

    path = predicted_ttft_config(tmp_path, 0.5)
    expected = copy.deepcopy(PREDICTED_TTFT_CONFIG)
    expected["plugins"][0]["parameters"] = {"podTimeScale": 0.5}  # the sim pods' clock, which they report on
    assert yaml.safe_load(path.read_text()) == {"scheduling": expected}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = resolve(parser.parse_args(["--endpoints", "127.0.0.1:8000", "--config-file", str(path)]))
    assert config.scheduling.plugins[0].type == "predicted-ttft-scorer"


def demand_scorer(window: float, floor: float = 2.0, keys: int = 4096) -> PredictedTTFTScorer:
    return PredictedTTFTScorer(prefill_tokens_per_second=RATE, prefill_fixed_seconds=FIXED, eviction_cost=0.0,
                               demand_window_seconds=window, demand_floor=floor, demand_keys=keys)


def wanted(s: PredictedTTFTScorer, holder: Endpoint, idle: Endpoint, picks: int, start: float = 0.0) -> float:
    """`picks` requests for one 1,920-token prefix, 20 ms apart, each answered before the next: demand without a
    queue. Returns the time after the last."""
    addresses = [holder.address, idle.address]
    now = start
    for i in range(picks):
        send(s, ctx(2048, [120 + i % 3, 0], now=now, addresses=addresses), holder)  # they diverge a block apart
        holder.finish_request(0)
        now += 0.02
    return now


def test_a_prefix_many_requests_want_is_copied_once_its_holder_queues() -> None:
    """A cold copy is paid once and then serves its share of the requests that want the prefix: with demand
    counted, the copy's tokens are charged to this request only in part, so a queue that the one request would sit
    out (pricing the whole copy) moves the prefix to a second pod; a short burst or old demand does not."""
    outcomes = {}
    for window, picks in ((0.0, 20), (1.0, 20), (1.0, 3)):
        s = demand_scorer(window)
        holder, idle = pod(1), pod(2)
        addresses = [holder.address, idle.address]
        now = wanted(s, holder, idle, picks)
        send(s, ctx(500, [0, 0], now=now, addresses=addresses), holder)  # 55 ms of other work queued on it
        predicted = s.predict(ctx(2048, [120, 0], now=now, addresses=addresses), [holder, idle])
        outcomes[(window, picks)] = predicted
        if window and picks == 20:  # the demand fades: a second later the copy is not worth it any more
            later = s.predict(ctx(2048, [120, 0], now=now + 5.0, addresses=addresses), [holder, idle])
            assert later[1].copy_share > 0.99
    alone, wanted_often, burst = outcomes[(0.0, 20)], outcomes[(1.0, 20)], outcomes[(1.0, 3)]
    assert alone[0].seconds < alone[1].seconds and alone[1].copy_share == 1.0  # no demand counted: stay and wait
    assert burst[0].seconds < burst[1].seconds and burst[1].copy_share == 1.0  # 3 picks: under the floor
    assert wanted_often[1].seconds < wanted_often[0].seconds  # 20 picks in 0.4 s: copy it
    share = wanted_often[1].copy_share
    assert 0.0 < share < 0.25 and wanted_often[0].copy_share == 1.0  # the holder copies nothing
    assert wanted_often[1].uncached_tokens == pytest.approx(2048)  # what the pod computes is unchanged
    assert wanted_often[1].prefill_s == pytest.approx(cost(2048 - (1 - share) * 1920))
    assert wanted_often[1].explain()["copy_share"] == share


def test_demand_is_counted_per_prefix_and_bounded() -> None:
    s = demand_scorer(10.0, floor=0.0, keys=4)
    holder, idle = pod(1), pod(2)
    wanted(s, holder, idle, 5)
    assert s.predict(ctx(2048, [120, 0], now=0.1), [holder, idle])[1].copy_share < 0.5
    other = ctx(2048, [120, 0], now=0.1)
    other.keys = [k + 1000 for k in other.keys]  # another prefix: no demand of its own
    assert s.predict(other, [holder, idle])[1].copy_share == 1.0
    for k in range(4):  # four other prefixes wanted since: the first is forgotten
        request = ctx(2048, [120, 0], now=0.2, addresses=[holder.address, idle.address])
        request.keys = [x + 10_000 * (k + 1) for x in request.keys]
        s.on_picked(request, holder, 0.2)
    assert s.predict(ctx(2048, [120, 0], now=0.2), [holder, idle])[1].copy_share == 1.0


def test_copy_demand_settings_are_checked() -> None:
    for key, bad in (("demandWindowSeconds", -1), ("demandFloor", -1), ("podTimeScale", 0)):
        with pytest.raises(ConfigError, match=rf"parameters\.{key}"):
            build_scheduler({**PREDICTED_TTFT_CONFIG, "plugins": [
                {"type": "predicted-ttft-scorer", "parameters": {key: bad}}]})
    config = predicted_ttft_scheduling(demandWindowSeconds=0)  # off: every copy charged whole
    scheduler = build_scheduler(config, rng=random.Random(0))
    result = scheduler.schedule(InferenceRequest("r", "m", prompt_text="hello " * 200), [pod(1), pod(2)], 0.0)
    assert all(c.details["predicted-ttft-scorer.copy_share"] == 1.0 for c in result.candidates)


def test_queues_and_demand_are_kept_on_the_pods_clock() -> None:
    """Pods simulated at a time scale report model seconds: a prefill they report as 10 ms keeps one busy for
    40 ms of our clock at podTimeScale 0.25. The same history at 4x our times predicts exactly what a scorer on the
    pods' clock predicts; a scorer that ignores the scale sees the queue drained and the demand faded too soon."""
    def history(scale: float) -> tuple[PredictedTTFTScorer, list[Prediction]]:
        s = PredictedTTFTScorer(prefill_tokens_per_second=RATE, prefill_fixed_seconds=FIXED, eviction_cost=0.0,
                                demand_window_seconds=0.5, demand_floor=1.0, pod_time_scale=scale)
        holder, idle = pod(1), pod(2)
        addresses = [holder.address, idle.address]
        for i in range(6):  # six requests for one prefix, 10 ms of pod time apart, queueing on the holder
            send(s, ctx(2048, [120, 0], now=0.01 * i / scale, addresses=addresses), holder)
        return s, s.predict(ctx(2048, [120, 0], now=0.06 / scale, addresses=addresses), [holder, idle])

    _, on_pod_clock = history(1.0)
    _, scaled = history(0.25)
    assert [p.seconds for p in scaled] == pytest.approx([p.seconds for p in on_pod_clock])
    assert [p.copy_share for p in scaled] == pytest.approx([p.copy_share for p in on_pod_clock])
    assert scaled[0].wait_s > 0.0 and scaled[1].copy_share < 1.0  # a queue, and enough demand for a copy
    unscaled = PredictedTTFTScorer(prefill_tokens_per_second=RATE, prefill_fixed_seconds=FIXED, eviction_cost=0.0,
                                   demand_window_seconds=0.5, demand_floor=1.0)
    holder, idle = pod(1), pod(2)
    for i in range(6):
        send(unscaled, ctx(2048, [120, 0], now=0.04 * i, addresses=[holder.address, idle.address]), holder)
    blind = unscaled.predict(ctx(2048, [120, 0], now=0.24, addresses=[holder.address, idle.address]), [holder, idle])
    assert blind[0].wait_s < scaled[0].wait_s and blind[1].copy_share > scaled[1].copy_share
