"""The picker's Prometheus endpoint carries GIE-compatible series after traffic through Envoy."""

from __future__ import annotations

import json

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.serving.metrics import PickerMetrics
from picker.serving.metrics.labels import ModelLabels
from tests.conftest import Stack
from tests.waiting import eventually_async


async def test_gie_metric_names_after_traffic(stack: Stack) -> None:
    envoy = stack.envoys["buffered"]
    async with aiohttp.ClientSession() as session:
        for data in (json.dumps({"model": "metrics-model", "prompt": "x"}).encode(), b"{"):
            async with session.post(envoy.url + "/v1/completions", data=data) as response:
                await response.read()
        async with session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
            text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("inference_objective_request", "inference_objective_request_error",
                 "inference_objective_request_duration_seconds", "inference_extension_scheduler_e2e_duration_seconds",
                 "inference_pool_ready_pods", "inference_pool_average_kv_cache_utilization"):
        assert name in families, name
    routed = [s for s in families["inference_objective_request"].samples
              if s.name.endswith("_total") and s.labels.get("model_name") == "metrics-model"]
    assert routed and routed[0].value >= 1
    errors = {s.labels["error_code"] for s in families["inference_objective_request_error"].samples
              if s.name.endswith("_total")}
    assert "invalid_json" in errors


async def test_usage_from_full_duplex_responses_feeds_token_metrics(stack: Stack) -> None:
    envoy = stack.envoys["full-duplex"]
    body = json.dumps({"model": "usage-model", "prompt": "u" * 4000, "stream": True}).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(envoy.url + "/v1/completions", data=body) as response:
            assert response.status == 200
            await response.read()
        text = ""

        async def usage_recorded() -> bool:
            # The picker records usage when Envoy ends the stream; the cached-token counter is written last.
            nonlocal text
            async with session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
                text = await response.text()
            return any(s.labels.get("model_name") == "usage-model" for f in text_string_to_metric_families(text)
                       if f.name == "picker_response_cached_tokens" for s in f.samples)

        await eventually_async(usage_recorded, "the picker recorded the token usage of the usage-model response")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    prompt = [s.value for s in families["picker_response_prompt_tokens"].samples
              if s.labels.get("model_name") == "usage-model" and s.name.endswith("_total")]
    cached = [s.value for s in families["picker_response_cached_tokens"].samples
              if s.labels.get("model_name") == "usage-model" and s.name.endswith("_total")]
    assert prompt == [len(body) // 4] and cached == [len(body) // 8]
    counts = [s.value for s in families["inference_objective_output_tokens"].samples
              if s.labels.get("model_name") == "usage-model" and s.name.endswith("_count")]
    assert counts == [1]


async def test_pool_gauges_follow_the_pool(stack: Stack) -> None:
    envoy = stack.envoys["buffered"]
    async with aiohttp.ClientSession() as session:
        async with session.post(envoy.url + "/v1/completions",
                                json={"model": "gauge-model", "prompt": "index me " * 50}) as response:
            assert response.status == 200
        samples: dict[tuple[str, str], float] = {}

        async def gauges_refreshed() -> bool:  # pool gauges refresh once a second
            nonlocal samples
            async with session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
                samples = {(s.name, s.labels.get("name", "")): s.value
                           for f in text_string_to_metric_families(await response.text()) for s in f.samples}
            return (samples.get(("inference_extension_prefix_indexer_size", ""), 0) > 0
                    and samples.get(("inference_pool_ready_pods", "default")) == len(stack.backends.addresses))

        await eventually_async(gauges_refreshed, "the pool gauges count every ready pod and a non-empty prefix index")
    assert samples[("inference_pool_ready_pods", "default")] == len(stack.backends.addresses)
    assert samples[("inference_pool_average_kv_cache_utilization", "default")] == 0.0
    assert samples[("inference_extension_prefix_indexer_size", "")] > 0


def test_scrape_counts_per_pod_and_a_departed_pod_leaves_no_series() -> None:
    metrics = PickerMetrics("pool")
    pod = Endpoint.from_address("10.0.0.1:8000")
    metrics.pool.observe_scrape(pod, True)
    metrics.pool.observe_scrape(pod, True)
    metrics.pool.observe_scrape(pod, False)
    text = generate_latest(metrics.registry).decode()
    assert 'picker_model_server_scrapes_total{model_server_pod="10.0.0.1:8000",name="pool",result="ok"} 2.0' in text
    assert 'result="error"} 1.0' in text
    metrics.forget_pod(pod)
    assert "10.0.0.1:8000" not in generate_latest(metrics.registry).decode()


def test_model_labels_are_what_the_pool_serves_or_configured() -> None:
    labels = ModelLabels(["configured"], limit=5)
    pod = Endpoint.from_address("10.0.0.1:8000")
    pod.metrics = EndpointMetrics(models=frozenset({"llama"}), running_loras=frozenset({"sql-lora"}))
    assert labels.label("llama") == "other"  # nothing scraped yet
    labels.learn([pod])
    assert [labels.label(m) for m in ("llama", "sql-lora", "configured", "", "guess")] == \
        ["llama", "sql-lora", "configured", "", "other"]
    pod.metrics = EndpointMetrics(waiting_loras=frozenset(f"a{i}" for i in range(100)))
    labels.learn([pod])
    assert sum(labels.label(f"a{i}") != "other" for i in range(100)) == 5 - 4  # the cap holds
    assert labels.label("llama") == "llama"  # learnt labels stay: a request ends under the label it started with


async def test_reference_series_running_requests_sizes_and_info(stack: Stack) -> None:
    envoy = stack.envoys["buffered"]
    body = json.dumps({"model": "metrics-model", "prompt": "sized " * 100}).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(envoy.url + "/v1/completions", data=body) as response:
            assert response.status == 200
        async with session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
            families = {f.name: f for f in text_string_to_metric_families(await response.text())}
    sizes = [s for s in families["inference_objective_request_sizes"].samples
             if s.name.endswith("_sum") and s.labels.get("model_name") == "metrics-model"]
    assert sizes and sizes[0].value >= len(body)
    assert [s.value for s in families["inference_extension_info"].samples] == [1.0]

    async def back_to_zero() -> bool:  # counted when routed, back down once Envoy ends the stream
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
            text = await response.text()
        running = [s.value for f in text_string_to_metric_families(text)
                   if f.name == "inference_objective_running_requests" for s in f.samples
                   if s.labels.get("model_name") == "metrics-model"]
        return running == [0.0]

    await eventually_async(back_to_zero, "metrics-model's running requests back to 0")
