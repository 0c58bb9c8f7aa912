"""Metrics-page parsing: vLLM against the captured vLLM 0.32 samples, SGLang and TensorRT-LLM against pages written
from their docs and source, and hand-made edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.endpoints.metrics import (
    parse_labels,
    parse_metrics,
    parse_trtllm_iteration_stats,
    parse_trtllm_metrics,
    parse_vllm_metrics,
)

SAMPLES = Path(__file__).resolve().parent / "data"  # vLLM 0.32 pages captured from a real server; the others written


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def test_idle_sample() -> None:
    m = parse_vllm_metrics(sample("vllm-0.32-cpu-idle.txt"), updated_at=12.5)
    assert (m.waiting, m.running, m.kv_usage) == (0.0, 0.0, 0.0)
    assert (m.block_size, m.num_gpu_blocks) == (128, 8192)
    assert (m.prefix_queries, m.prefix_hits) == (71.0, 0.0)
    # the predicted-TTFT scorer's cost fit: 4 prefills, 71 tokens, 24.8 ms in all
    assert (m.prefill_count, m.prefill_tokens, round(m.prefill_seconds, 4)) == (4.0, 71.0, 0.0248)
    assert (m.max_lora, m.running_loras, m.waiting_loras) == (0, frozenset(), frozenset())
    assert m.updated_at == 12.5


def test_lora_sample_takes_the_newest_lora_series() -> None:
    m = parse_vllm_metrics(sample("vllm-0.32-cpu-lora.txt"))
    assert (m.block_size, m.num_gpu_blocks) == (128, 24)
    assert (m.prefix_queries, m.prefix_hits) == (13500.0, 768.0)
    # Two series: the older (…728.55) lists tinylora, the newer (…730.18) lists none: the newer wins.
    assert m.max_lora == 2
    assert m.running_loras == frozenset() and m.waiting_loras == frozenset()


def test_lora_sample_with_series_order_swapped() -> None:
    text = sample("vllm-0.32-cpu-lora.txt").replace("1.7959757301882033e+09", "1.0e+09")
    m = parse_vllm_metrics(text)
    assert m.running_loras == frozenset({"tinylora"}) and m.waiting_loras == frozenset({"tinylora"})


def test_engines_add_up_and_kv_is_their_mean() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_waiting Number of requests waiting.",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 2 1700000000000',
        'vllm:num_requests_running{engine="1",model_name="m"} 5',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0',
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1500"} 1.0',
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a, b",waiting_lora_adapters="c"} 20.0',
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 10.0',
        "vllm:prefix_cache_queries_total 100",
        "vllm:prefix_cache_hits_total NaN",
        "vllm:num_requests_waiting{engine=\"2\"} garbage",
        "vllm:num_requests_waiting{engine=\"3\"",
        "not_vllm:num_requests_waiting 50",
        "",
    ])
    m = parse_vllm_metrics(text)
    assert (m.waiting, m.running) == (7.0, 7.0)
    assert m.kv_usage == pytest.approx(0.5)
    assert (m.block_size, m.num_gpu_blocks) == (16, 2500)
    assert (m.max_lora, m.running_loras, m.waiting_loras) == (4, frozenset({"a", "b"}), frozenset({"c"}))
    assert (m.prefix_queries, m.prefix_hits) == (100.0, 0.0)


def test_old_kv_name_and_empty_text() -> None:
    assert parse_vllm_metrics('vllm:gpu_cache_usage_perc{engine="0"} 0.4\n').kv_usage == 0.4
    m = parse_vllm_metrics("")
    assert (m.waiting, m.kv_usage, m.block_size, m.num_gpu_blocks, m.max_lora) == (0.0, 0.0, None, None, 0)


def test_label_escapes() -> None:
    assert parse_labels(r'a="x\"y",b="1\\2",c="line\nbreak",d="} {"') == {
        "a": 'x"y', "b": "1\\2", "c": "line\nbreak", "d": "} {"}


def test_an_sglang_page_is_read_in_its_own_names() -> None:
    """SGLang's /metrics (tests/data/sglang_metrics.txt, two data-parallel ranks): queue and running add up, KV use
    is the ranks' mean, the model comes from `model_name`; parse_metrics tells the engine from the page."""
    text = (Path(__file__).parent / "data" / "sglang_metrics.txt").read_text()
    m = parse_metrics(text, updated_at=5.0)
    assert (m.waiting, m.running, m.kv_usage, m.updated_at) == (7.0, 21.0, 0.375, 5.0)
    assert m.models == frozenset({"Qwen/Qwen2.5-7B-Instruct"})
    assert m.prefix_queries == 0 and m.block_size is None  # no such series in SGLang's page
    vllm = 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
    assert parse_metrics(vllm).waiting == 2.0 and parse_metrics("").waiting == 0.0


def test_a_trtllm_page_is_read_in_its_own_names() -> None:
    """trtllm-serve's /prometheus/metrics (tests/data/trtllm_metrics.txt): queue, running count, KV use (used of max
    blocks), the cache geometry and the model from `model_name`; parse_metrics tells the engine from the page."""
    m = parse_metrics(sample("trtllm_metrics.txt"), updated_at=3.0)
    assert (m.waiting, m.running, m.kv_usage, m.updated_at) == (5.0, 12.0, 0.4375, 3.0)
    assert (m.block_size, m.num_gpu_blocks) == (32, 64000)
    assert m.models == frozenset({"meta-llama/Llama-3.1-8B-Instruct"})
    assert parse_trtllm_metrics(sample("trtllm_metrics.txt")) == parse_metrics(sample("trtllm_metrics.txt"))


def test_trtllm_series_add_up_and_a_placeholder_model_is_no_model() -> None:
    # Before any request finished only the startup info is there; older releases wrote model_name="undefined".
    startup = 'trtllm_model_config_info{model_name="m",engine_type="pytorch",served_model_name="m",pid="9"} 1.0\n'
    m = parse_metrics("# HELP trtllm_num_requests_running Multiprocess metric\n" + startup)
    assert (m.waiting, m.running, m.kv_usage, m.models) == (0.0, 0.0, 0.0, frozenset({"m"}))
    text = "\n".join([
        'trtllm_num_requests_running{model_name="undefined",engine_type="undefined",pid="1"} 3.0',
        'trtllm_num_requests_running{model_name="undefined",engine_type="undefined",pid="2"} 4.0',
        'trtllm_num_requests_waiting{pid="1"} 2.0',
        'trtllm_num_requests_waiting{pid="2"} NaN',
        'trtllm_kv_cache_utilization{pid="1"} 0.2',
        'trtllm_kv_cache_utilization{pid="2"} 0.6',
        'trtllm_kv_cache_max_blocks{pid="1"} 100.0',
        'trtllm_kv_cache_max_blocks{pid="2"} +Inf',
        'trtllm_kv_cache_tokens_per_block{pid="1"} 64.0',
        'xtrtllm_num_requests_waiting 50',
        "",
    ])
    m = parse_metrics(text)
    assert (m.waiting, m.running, m.models) == (2.0, 7.0, frozenset())
    assert m.kv_usage == pytest.approx(0.4)
    assert (m.block_size, m.num_gpu_blocks) == (64, 100)


def test_a_vllm_page_that_mentions_trtllm_stays_vllm() -> None:
    text = ('vllm:cache_config_info{block_size="16",use_trtllm_attention="None"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n')
    assert parse_metrics(text).waiting == 4.0 and parse_metrics(text).block_size == 16


def test_trtllm_iteration_stats_take_the_newest_iteration() -> None:
    """trtllm-serve's JSON /metrics (tests/data/trtllm_metrics.json): the entry with the highest `iter` counts, not
    the last one; an empty list (no iteration since the last read) is an idle engine; it names no model."""
    m = parse_metrics(sample("trtllm_metrics.json"), updated_at=4.0)
    assert (m.waiting, m.running, m.kv_usage, m.updated_at) == (5.0, 12.0, 0.4375, 4.0)
    assert (m.block_size, m.num_gpu_blocks, m.models) == (32, 64000, frozenset())
    idle = parse_metrics("[]", updated_at=4.0)
    assert (idle.waiting, idle.running, idle.kv_usage, idle.block_size, idle.updated_at) == (0.0, 0.0, 0.0, None, 4.0)
    only_free = parse_trtllm_iteration_stats(
        '[{"numActiveRequests": true, "numQueuedRequests": 2, "kvCacheStats": {"maxNumBlocks": 80, "freeNumBlocks": 60}}, 7]')
    assert (only_free.running, only_free.waiting, only_free.kv_usage, only_free.block_size) == (0.0, 2.0, 0.25, None)


@pytest.mark.parametrize("text", ['{"iter": 1}', "[1, 2", "[" * 100_000 + "]" * 100_000])
def test_unreadable_iteration_stats_are_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_trtllm_iteration_stats(text)
