"""Every metric family the reference picker documents (its metrics catalog: current `llm_d_epp_*` names and the
deprecated names it still emits) is in ours, with its labels, through real Envoy; or it belongs to a feature we do
not have, listed below with the reason."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker import __version__
from picker.serving.metrics import PickerMetrics
from picker_lab.supervisor import (
    Envoy,
    Picker,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_envoy,
    start_picker,
    wait_until,
)

L = ("model_name", "target_model_name", "fairness_id", "priority")
POOL = ("name",)
INDEXER = ("plugin_name", "plugin_type")
FLOW = ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")
FLOW_AND_OUTCOME = ("fairness_id", "priority", "outcome", "inference_pool", "model_name", "target_model_name")
# family -> its labels, as the reference's catalog documents them
CURRENT: dict[str, tuple[str, ...]] = {
    "llm_d_epp_request_total": L, "llm_d_epp_request_error_total": (*L, "error_code"),
    "llm_d_epp_request_duration_seconds": L, "llm_d_epp_request_size_bytes": L,
    "llm_d_epp_response_size_bytes": L, "llm_d_epp_request_input_tokens": L, "llm_d_epp_request_output_tokens": L,
    "llm_d_epp_request_cached_tokens": L, "llm_d_epp_request_running": L, "llm_d_epp_request_ntpot_seconds": L,
    "llm_d_epp_request_ttft_seconds": (*L, "streaming"), "llm_d_epp_request_streaming_tpot_seconds": L,
    "llm_d_epp_request_streaming_itl_seconds": L,
    "llm_d_epp_average_kv_cache_utilization": POOL, "llm_d_epp_average_queue_size": POOL,
    "llm_d_epp_average_running_requests": POOL, "llm_d_epp_std_dev_kv_cache_utilization": POOL,
    "llm_d_epp_std_dev_queue_size": POOL, "llm_d_epp_std_dev_running_requests": POOL,
    "llm_d_epp_ready_endpoints": POOL, "llm_d_epp_per_endpoint_queue_size": ("name", "model_server_endpoint"),
    "llm_d_epp_scheduler_e2e_duration_seconds": (),
    "llm_d_epp_scheduler_attempts_total": ("status", "target_model_name", "endpoint_name", "namespace", "port"),
    "llm_d_epp_request_processing_duration_seconds": (), "llm_d_epp_response_processing_duration_seconds": (),
    "llm_d_epp_plugin_duration_seconds": ("extension_point", "plugin_type", "plugin_name"),
    "llm_d_epp_info": ("commit", "build_ref"),
    "llm_d_epp_model_rewrite_decisions_total": ("model_rewrite_name", "model_name", "target_model"),
    "llm_d_epp_datalayer_poll_errors_total": ("source_type",),
    "llm_d_epp_datalayer_extract_errors_total": ("source_type", "extractor_type"),
    "llm_d_epp_prefix_indexer_size": INDEXER, "llm_d_epp_prefix_indexer_hit_ratio": INDEXER,
    "llm_d_epp_prefix_indexer_hit_bytes": INDEXER,
    "llm_d_epp_inflight_requests": ("endpoint_name", "namespace", "producer_name", "fairness_id", "priority"),
    "llm_d_epp_inflight_tokens": ("endpoint_name", "namespace", "producer_name", "fairness_id", "priority"),
    # with --enable-grpc-stream-metrics, as there
    "llm_d_epp_extproc_streams_inflight": (), "llm_d_epp_extproc_stream_duration_seconds": (),
    "llm_d_epp_extproc_streams_total": ("code",),
    # with flow control on (admission.flowControl.enabled), as there with its feature gate
    "llm_d_epp_flow_control_requests_total": ("outcome", "priority", "inference_pool"),
    "llm_d_epp_flow_control_request_queue_duration_seconds": FLOW_AND_OUTCOME,
    "llm_d_epp_flow_control_dispatch_cycle_duration_seconds": (),
    "llm_d_epp_flow_control_request_enqueue_duration_seconds": ("fairness_id", "priority", "outcome"),
    "llm_d_epp_flow_control_queue_size": FLOW, "llm_d_epp_flow_control_queue_bytes": FLOW,
    "llm_d_epp_flow_control_pool_saturation": ("inference_pool", "stage"),
    "llm_d_epp_flow_control_stale_endpoints": ("detector",),
    "llm_d_epp_flow_control_capacity_utilization_requests": ("priority", "inference_pool"),
    "llm_d_epp_flow_control_capacity_utilization_bytes": ("priority", "inference_pool"),
}
MODELS = ("model_name", "target_model_name")
DEPRECATED: dict[str, tuple[str, ...]] = {
    "inference_objective_request_total": (*MODELS, "priority"),
    "inference_objective_request_error_total": (*MODELS, "error_code"),
    "inference_objective_request_duration_seconds": MODELS, "inference_objective_request_sizes": MODELS,
    "inference_objective_response_sizes": MODELS, "inference_objective_input_tokens": MODELS,
    "inference_objective_output_tokens": MODELS, "inference_objective_prompt_cached_tokens": MODELS,
    "inference_objective_normalized_time_per_output_token_seconds": MODELS,
    "inference_objective_running_requests": ("model_name",),
    "inference_objective_request_ttft_seconds": MODELS, "inference_objective_request_tpot_seconds": MODELS,
    "inference_pool_average_kv_cache_utilization": POOL, "inference_pool_average_queue_size": POOL,
    "inference_pool_average_running_requests": POOL, "inference_pool_ready_pods": POOL,
    "inference_pool_per_pod_queue_size": ("name", "model_server_pod"),
    "inference_extension_scheduler_e2e_duration_seconds": (),
    "inference_extension_scheduler_attempts_total": ("status", "target_model_name", "pod_name", "namespace", "port"),
    "inference_extension_plugin_duration_seconds": ("extension_point", "plugin_type", "plugin_name"),
    "inference_extension_info": ("commit", "build_ref"),
    "inference_extension_model_rewrite_decisions_total": ("model_rewrite_name", "model_name", "target_model"),
    "inference_extension_prefix_indexer_size": (), "inference_extension_prefix_indexer_hit_ratio": (),
    "inference_extension_prefix_indexer_hit_bytes": (),
    "llm_d_inference_scheduler_datalayer_poll_errors_total": ("source_type",),
    "llm_d_inference_scheduler_datalayer_extract_errors_total": ("source_type", "extractor_type"),
    "inference_extension_flow_control_request_queue_duration_seconds": FLOW_AND_OUTCOME,
    "inference_extension_flow_control_dispatch_cycle_duration_seconds": (),
    "inference_extension_flow_control_request_enqueue_duration_seconds": ("fairness_id", "priority", "outcome"),
    "inference_extension_flow_control_queue_size": FLOW, "inference_extension_flow_control_queue_bytes": FLOW,
    "inference_extension_flow_control_pool_saturation": ("inference_pool", "stage"),
}
# The catalog's families of features picker does not have (so nothing to count), by prefix.
NOT_HERE = {
    "llm_d_epp_flow_control_global_capacity_": "flow control bounds each band, it offers no global bound",
    "llm_d_epp_flow_control_revocation": "dispatched requests are never evicted",
    "llm_d_epp_flow_control_reclaim": "dispatched requests are never evicted",
    "llm_d_epp_flow_control_pending_reclaim": "dispatched requests are never evicted",
    "llm_d_epp_encoder_cache_": "multimodal encoder-cache affinity is not implemented",
    "llm_d_epp_program_aware_": "program-aware fairness belongs to flow control",
    "llm_d_epp_request_predicted_": "the latency-predictor sidecars are not used (predicted TTFT: picker_ttft_*)",
    "llm_d_epp_pd_decision": "counted as llm_d_epp_disagg_decision_total (plugin_type pd-profile-handler)",
    "llm_d_epp_kv_cache_": "the KV-event (precise) prefix index is not implemented",
}


TOTALS: dict[str, float] = {}  # sample name -> value summed over labels, from the fixture's scrape


@pytest.fixture(scope="module")
def scraped() -> Iterator[dict[str, set[str]]]:
    """family -> label names, from a picker behind full-duplex Envoy (response bodies visible) after a streamed
    and a plain request, one with its model rewritten, and a refusal."""
    with process_scope("reference-metrics") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        for address in backends.addresses:  # the rewrite's target is a model the pods serve too
            set_echo_metrics(address, models=["tiny", "tiny-v2"])
        picker = start_picker(logdir, endpoints=backends.addresses, extra=[
            "--enable-grpc-stream-metrics", "--config-text", "admission: {flowControl: {enabled: true}}"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses, mode="full-duplex")
        started.append(envoy.process)
        yield _families(picker, envoy, backends.addresses)


async def _send(envoy: Envoy) -> None:
    async with aiohttp.ClientSession() as session:
        for i in range(20):  # plugins are timed on one request in 16
            body = {"model": "tiny", "prompt": f"plain {i} " * 20, "stream": i % 2 == 0,
                    "test_events": 3, "test_event_delay": 0.02}  # the echo pod's events, spaced: separate chunks
            headers = {"x-gateway-model-name-rewrite": "tiny-v2"} if i == 0 else {}
            async with session.post(envoy.url + "/v1/completions", json=body, headers=headers) as response:
                assert response.status == 200
                await response.read()
        async with session.post(envoy.url + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400


def _set_pods(pods: list[str], waiting: int) -> None:
    for pod in pods:
        set_echo_metrics(pod, waiting=waiting)


async def _scrape_while_queued(envoy: Envoy, pods: list[str], scrape: Callable[[], str], picker: Picker) -> str:
    """The pods report full queues, two requests wait in flow control: scrape then (the queue series have
    samples), let them through, wait until they are done."""
    _set_pods(pods, 20)
    wait_until(lambda: "llm_d_epp_average_queue_size{name=\"default\"} 20.0" in scrape(), 10, "the full pods seen",
               picker.process.proc)
    async with aiohttp.ClientSession() as session:
        waiting = [asyncio.create_task(session.post(envoy.url + "/v1/completions", json={
            "model": "tiny", "prompt": f"queued {i}"})) for i in range(2)]
        text = ""
        for _ in range(100):
            text = await asyncio.to_thread(scrape)
            queued = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("llm_d_epp_flow_control_queue_size{"))
            if queued == 2:
                break
            await asyncio.sleep(0.05)
        _set_pods(pods, 0)
        for response in await asyncio.gather(*waiting):
            assert response.status == 200
            response.release()
    return text


def _families(picker: Picker, envoy: Envoy, pods: list[str]) -> dict[str, set[str]]:
    asyncio.run(_send(envoy))
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    wait_until(lambda: "llm_d_epp_extproc_streams_inflight 0.0" in scrape(), 10, "every ext_proc stream ended",
               picker.process.proc)
    text = asyncio.run(_scrape_while_queued(envoy, pods, scrape, picker))
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            TOTALS[sample.name] = TOTALS.get(sample.name, 0.0) + sample.value
            name = sample.name
            for suffix in ("_bucket", "_sum", "_count", "_created"):
                if name.endswith(suffix) and family.type == "histogram":
                    name = name[: -len(suffix)]
            out.setdefault(name, set()).update(k for k in sample.labels if k != "le")
    return out


@pytest.mark.parametrize("catalog", [CURRENT, DEPRECATED], ids=["current", "deprecated"])
def test_every_documented_family_is_exported_with_its_labels(scraped: dict[str, set[str]],
                                                             catalog: dict[str, tuple[str, ...]]) -> None:
    missing = sorted(name for name in catalog if name not in scraped)
    assert not missing, missing
    wrong = {name: (sorted(scraped[name]), sorted(labels)) for name, labels in catalog.items()
             if scraped[name] != set(labels)}
    assert not wrong, wrong


def test_the_info_metric_carries_our_version() -> None:
    samples = [s for f in PickerMetrics().registry.collect() if f.name in ("llm_d_epp_info", "inference_extension_info")
               for s in f.samples]
    assert [(s.labels["build_ref"], s.value) for s in samples] == [(f"picker-{__version__}", 1.0)] * 2


def test_what_is_not_here_is_not_claimed(scraped: dict[str, set[str]]) -> None:
    assert not [name for name in scraped for prefix in NOT_HERE if name.startswith(prefix)]


def test_the_series_count_what_happened(scraped: dict[str, set[str]]) -> None:
    """20 requests routed (10 streamed), one rewritten, one refused; Envoy showed every response body."""
    t = TOTALS
    assert t["llm_d_epp_request_total"] == t["inference_objective_request_total"] == 21  # before the 2 queued
    assert t["llm_d_epp_request_error_total"] == 1 and t["llm_d_epp_scheduler_attempts_total"] == 20
    assert t["llm_d_epp_request_ttft_seconds_count"] == t["llm_d_epp_response_size_bytes_count"] == 20
    assert t["llm_d_epp_request_output_tokens_count"] == 20 and t["llm_d_epp_request_ntpot_seconds_count"] == 20
    assert t["llm_d_epp_request_streaming_tpot_seconds_count"] == 10
    assert t["llm_d_epp_request_streaming_itl_seconds_count"] >= 10 * 2  # 3+ spaced chunks per stream
    assert t["llm_d_epp_model_rewrite_decisions_total"] == 1
    assert t["llm_d_epp_plugin_duration_seconds_count"] >= 1  # one request in 16, each of its plugins
    assert t["llm_d_epp_request_running"] == 0 and t["llm_d_epp_request_processing_duration_seconds_count"] == 20
    assert t["llm_d_epp_extproc_streams_total"] == 21  # one stream per request, each ended
    assert t["llm_d_epp_flow_control_queue_size"] == 2  # the two queued at the scrape
    assert t["llm_d_epp_flow_control_requests_total"] == 20  # dispatched at once (the bad body never got there)


def test_the_deprecated_names_can_be_turned_off() -> None:
    names = {f.name for f in PickerMetrics(deprecated_names=False).registry.collect()}
    assert "llm_d_epp_request" in names and "llm_d_epp_info" in names
    assert not {n for n in names if n.startswith(("inference_", "llm_d_inference_scheduler_"))}
    on = {f.name for f in PickerMetrics().registry.collect()}
    assert "inference_extension_info" in on and "inference_objective_request" in on


def test_a_picker_without_deprecated_names_serves_only_the_current_ones_through_envoy() -> None:
    with process_scope("current-names") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=["--metrics-deprecated-names=false"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses)
        started.append(envoy.process)
        request = urllib.request.Request(envoy.url + "/v1/completions", data=b'{"model": "tiny", "prompt": "x"}',
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        url = f"http://{picker.host}:{picker.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            families = list(text_string_to_metric_families(response.read().decode()))
    names = {f.name for f in families}
    assert not {n for n in names if n.startswith(("inference_", "llm_d_inference_scheduler_"))}, names
    assert sum(s.value for f in families if f.name == "llm_d_epp_request" for s in f.samples
               if s.name.endswith("_total")) == 1
