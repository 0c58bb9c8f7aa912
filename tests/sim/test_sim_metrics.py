"""The simulated /metrics exposes the same vllm:* families, labels and buckets as a real vLLM 0.32."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from picker_lab.sim.engine import Engine, SimRequest
from picker_lab.sim.metrics import SimMetrics, build_1_2_5_buckets
from picker_lab.sim.profiles import TINY_CPU

SAMPLES = Path(__file__).resolve().parent.parent / "data"  # /metrics pages captured from a real vLLM 0.32


def families(text: str) -> dict[str, list[Sample]]:
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def label_keys(samples: list[Sample]) -> set[tuple[str, ...]]:
    return {tuple(sorted(s.labels)) for s in samples}


def run_some_requests(lora: bool = False) -> SimMetrics:
    engine = Engine(TINY_CPU, lora_modules={"tinylora": "/x"} if lora else None)
    metrics = SimMetrics(engine, "tiny", lora_enabled=lora, process_metrics=False)
    prompt = list(range(100, 400))
    engine.add_request(SimRequest("a", prompt, 5, lora_name="tinylora" if lora else None), 0.0)
    engine.add_request(SimRequest("b", prompt, 3), 0.0)
    now = 0.0
    while engine.has_work():
        result = engine.step(max(now, engine.next_step_time() or 0.0))
        now = result.end
        metrics.observe_step(result)
    engine.add_request(SimRequest("c", prompt, 3), now)
    while engine.has_work():
        result = engine.step(max(now, engine.next_step_time() or 0.0))
        now = result.end
        metrics.observe_step(result)
    return metrics


def test_family_names_labels_and_buckets_match_the_capture() -> None:
    real = families((SAMPLES / "vllm-0.32-cpu-idle.txt").read_text())
    ours = families(run_some_requests().render().decode())
    assert set(ours) == set(real)
    for name, samples in real.items():
        assert label_keys(ours[name]) == label_keys(samples), name
        real_le = [s.labels["le"] for s in samples if "le" in s.labels]
        if real_le:
            our_le = [s.labels["le"] for s in ours[name] if "le" in s.labels]
            assert our_le == real_le, name


def test_lora_info_family_like_the_lora_capture() -> None:
    real = families((SAMPLES / "vllm-0.32-cpu-lora.txt").read_text())
    ours = families(run_some_requests(lora=True).render().decode())
    assert set(ours) == set(real)
    info = ours["vllm:lora_requests_info"]
    assert label_keys(info) == label_keys(real["vllm:lora_requests_info"])
    assert {s.labels["max_lora"] for s in info} == {"2"}
    assert any(s.labels["running_lora_adapters"] == "tinylora" for s in info)
    # as in vLLM 0.32 (and the capture): both labels list every adapter with an unfinished request
    assert all(s.labels["running_lora_adapters"] == s.labels["waiting_lora_adapters"] for s in info)
    assert {s.labels["running_lora_adapters"] for s in info} == {"", "tinylora"}
    assert all(s.value > 1.7e9 for s in info)  # a wall-clock timestamp: consumers take the newest series


def test_values_follow_the_engine() -> None:
    text = run_some_requests().render().decode()
    fams = families(text)

    def value(family: str, sample: str | None = None, **labels: str) -> float:
        for s in fams[family]:
            if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        raise KeyError(family)

    # a and b arrive together: b already hits the 2 full blocks of 128 that a computes in the same step (vLLM caches
    # blocks when the step is scheduled); c hits them too. The last prompt token is never a hit.
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 900
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 512
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 900
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 11
    assert value("vllm:request_success", finished_reason="length") == 3
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:num_requests_running") == 0
    assert value("vllm:kv_cache_usage_perc") == 0
    info = fams["vllm:cache_config_info"][0]
    assert info.value == 1.0
    assert info.labels["block_size"] == "128" and info.labels["num_gpu_blocks"] == "8192"
    assert info.labels["enable_prefix_caching"] == "True"
    assert info.labels["prefix_caching_hash_algo"] == "sha256"
    assert info.labels["engine"] == "0"
    assert all(s.labels.get("model_name") == "tiny" for s in fams["vllm:num_requests_waiting"])


def test_token_buckets_follow_max_model_len() -> None:
    assert build_1_2_5_buckets(4096)[-1] == 2000.0
    assert build_1_2_5_buckets(8192)[-1] == 5000.0
    assert build_1_2_5_buckets(4096)[:4] == [1.0, 2.0, 5.0, 10.0]


def test_each_instance_has_its_own_registry() -> None:
    a = run_some_requests()
    b = SimMetrics(Engine(TINY_CPU), "tiny", process_metrics=False)
    assert a.registry is not b.registry
    assert "vllm:generation_tokens_total" in a.render().decode()
    assert b'vllm:generation_tokens_total{engine="0",model_name="tiny"} 0.0' in b.render()


def test_fast_exposition_is_byte_identical_to_prometheus_client() -> None:
    from prometheus_client import generate_latest

    engine = Engine(TINY_CPU)
    metrics = SimMetrics(engine, "tiny")
    now = 0.0
    for round_ in range(3):  # render, change the histograms, render again: the render cache must follow
        engine.add_request(SimRequest(f"r{round_}", list(range(100, 400 + 50 * round_)), 4), now)
        while engine.has_work():
            result = engine.step(max(now, engine.next_step_time() or 0.0))
            now = result.end
            metrics.observe_step(result)
        rendered = metrics.render()
        # Process metrics (CPU seconds, memory) move between two reads: compare our own families exactly.
        ours = generate_latest(metrics.registry).split(b"# HELP vllm:", 1)[1]
        assert rendered.split(b"# HELP vllm:", 1)[1] == ours
    odd = SimMetrics(engine, 'we"ird\\name\nx', process_metrics=False)
    assert odd.render() == generate_latest(odd.registry)
