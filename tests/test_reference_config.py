"""The reference picker's EndpointPickerConfig files load unchanged (tests/data/reference_configs, written from its
documentation, chart and samples): each gives the profile it describes, the settings its non-scheduling plugins
carry land where ours live, and a plugin we do not implement is a clear error naming it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from picker.cli import main
from picker.scheduling.config import StrategyDeps, build_strategy
from picker.scheduling.scheduler import PrefixAwareScheduler
from picker.serving.config import ConfigError, ServeConfig, add_arguments, resolve
from picker_lab.supervisor import free_port, process_scope, spawn, start_envoy, start_picker, wait_until
from tests.kubefake import FakeKubeThread
from tests.test_kubernetes_discovery import LABELS, NS, _bound, _served_by

CONFIGS = Path(__file__).resolve().parent / "data" / "reference_configs"


def load(name: str, *argv: str, notes: list[str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(["--endpoints", "127.0.0.1:8000", "--config-file", str(CONFIGS / name), *argv])
    return resolve(args, notes)


def profiles_of(config: ServeConfig) -> dict[str, Any]:
    """profile -> (filters, {scorer type: weight}, picker type), as the scheduler built from it runs them."""
    scheduler = build_strategy(config.strategy, StrategyDeps(config.scheduling, saturation=config.admission.thresholds))
    assert isinstance(scheduler, PrefixAwareScheduler)
    return {name: ([f.name for f in p.filters], {w.scorer.name: w.weight for w in p.scorers},
                   type(p.picker).__name__) for name, p in scheduler.profiles.items()}


@pytest.mark.parametrize("name,profiles", [
    ("chart-default.yaml", {"default": ([], {"queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                                             "prefix-cache-scorer": 3}, "MaxScorePicker")}),
    ("chart-default-older.yaml", {"default": ([], {"queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                                                   "prefix-cache-scorer": 3}, "MaxScorePicker")}),
    ("prefix-guide-older.yaml", {"default": ([], {"prefix-cache-scorer": 50}, "MaxScorePicker")}),
    ("without-disaggregation.yaml", {"default": (["decode-filter"], {"prefix-cache-scorer": 2}, "MaxScorePicker")}),
    ("estimated-prefix-load-aware.yaml", {"default": (["decode-filter"], {"prefix-cache-scorer": 1,
                                                                          "load-aware-scorer": 1}, "MaxScorePicker")}),
    ("approximate-producer.yaml", {"default": (["decode-filter"], {"prefix-cache-scorer": 2}, "MaxScorePicker")}),
    ("optimized-baseline.yaml", {"default": ([], {"queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                                                  "prefix-cache-scorer": 3, "no-hit-lru-scorer": 2},
                                             "MaxScorePicker")}),
    ("disaggregated.yaml", {
        "prefill": (["prefill-filter"], {"prefix-cache-scorer": 2, "queue-scorer": 1}, "MaxScorePicker"),
        "decode": (["decode-filter"], {"prefix-cache-scorer": 2, "queue-scorer": 1}, "MaxScorePicker")}),
    ("mm-embeddings-cache.yaml", {"default": ([], {"prefix-cache-scorer": 3, "mm-embeddings-cache-scorer": 2,
                                                   "queue-scorer": 1}, "MaxScorePicker")}),
    ("data-parallel.yaml", {"default": ([], {"queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                                             "prefix-cache-scorer": 3}, "MaxScorePicker")}),
    ("openai-parser-lora.yaml", {"default": ([], {"queue-scorer": 1, "kv-cache-utilization-scorer": 1,
                                                  "prefix-cache-scorer": 1, "lora-affinity-scorer": 1},
                                             "MaxScorePicker")}),
])
def test_each_reference_config_gives_the_profile_it_describes(name: str, profiles: dict[str, Any]) -> None:
    assert profiles_of(load(name)) == profiles


def test_the_multimodal_producers_cache_size_sizes_the_media_scorer() -> None:
    from picker.scheduling.media import MediaAffinityScorer

    config = load("mm-embeddings-cache.yaml")
    scheduler = build_strategy(config.strategy, StrategyDeps(config.scheduling))
    assert isinstance(scheduler, PrefixAwareScheduler)
    media = [w.scorer for p in scheduler.profiles.values() for w in p.scorers
             if isinstance(w.scorer, MediaAffinityScorer)]
    assert [m.entries_per_pod for m in media] == [512]  # 1024 MiB at the reference's 2 MiB an image


def test_settings_of_non_scheduling_plugins_land_where_ours_live() -> None:
    notes: list[str] = []
    older = load("prefix-guide-older.yaml", notes=notes)
    pc = older.scheduling.prefix_cache
    assert (pc.block_chars, pc.default_block_chars, pc.max_prefix_blocks_to_match, pc.lru_capacity_per_server) \
        == (None, 5, 256, 31250)  # autoTune (its default): the pods' block size wins once reported, 5 until then
    thresholds = older.admission.thresholds
    assert (thresholds.queue, thresholds.kv_cache, thresholds.stale) == (8, 0.75, 0.15)
    assert notes == ["featureGates: dataLayer changes nothing here (picker's data layer is always on)"]
    producer = load("approximate-producer.yaml").scheduling.prefix_cache
    assert producer.max_prefix_blocks_to_match == 16384 * 4 // 64 and producer.lru_capacity_per_server == 31250
    chart = load("chart-default.yaml")
    assert (chart.model_server_metrics_scheme, chart.model_server_metrics_path,
            chart.model_server_metrics_https_insecure_skip_verify) == ("http", "/metrics", True)
    flagged = load("chart-default.yaml", "--model-server-metrics-path", "/stats")
    assert flagged.model_server_metrics_path == "/stats"  # a flag beats what the file's plugins imply


def test_the_data_parallel_handler_runs_as_the_single_profile_handler_and_says_so() -> None:
    notes: list[str] = []
    load("data-parallel.yaml", notes=notes)
    assert len(notes) == 1 and "data-parallel-profile-handler runs as single-profile-handler" in notes[0] \
        and "primaryPort 8000" in notes[0] and "x-data-parallel-rank" in notes[0], notes


@pytest.mark.parametrize("name,message", [
    ("refused-encode.yaml", r"plugins\[0\]\.type: 'encode-filter' .* encode disaggregation"),
    ("refused-payload-agnostic.yaml", r"plugins\[0\]\.type: 'passthrough-parser' .* OpenAI-style body"),
])
def test_plugins_we_do_not_implement_are_named(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(name)


@pytest.mark.parametrize("text,message", [
    ("apiVersion: example.com/v1\nkind: EndpointPickerConfig\n", r"apiVersion: 'example.com/v1' is not one"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: Other\n", "kind: 'Other', expected EndpointPickerConfig"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nscheduler: {}\n", "scheduler: not a field"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [warpDrive]\n",
     r"featureGates\[0\]: feature gate 'warpDrive' is unknown"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: prefix-cache-scorer\n"
     "  parameters: {blockSize: many}\n", r"plugins\[0\]\.parameters\.blockSize"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: metrics-data-source\n"
     "  parameters: {caCertPath: /ca.pem}\n", r"plugins\[0\]\.parameters\.caCertPath"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: core-metrics-extractor\n"
     "  parameters: {defaultEngine: sglang}\n", r"plugins\[0\]\.parameters\.defaultEngine"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: teleport-scorer\n",
     "unknown plugin type 'teleport-scorer'"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: single-profile-handler\n"
     "- type: queue-scorer\nschedulingProfiles:\n- {name: a, plugins: [{pluginRef: queue-scorer}]}\n"
     "- {name: b, plugins: [{pluginRef: queue-scorer}]}\n", "single-profile-handler runs one profile, not 2"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n- type: data-parallel-profile-handler\n"
     "  parameters: {primaryPort: 70000}\n", r"plugins\[0\]\.parameters\.primaryPort"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\ndataLayer: {discovery: {pluginRef: x}}\n",
     "dataLayer.discovery: not supported"),
])
@pytest.mark.timeout(30)  # a config that wrongly passes would start serving
def test_bad_reference_configs_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                            message: str) -> None:
    """Whether found decoding the file or building its plugin graph: exit 2 before any port opens, naming the
    file and the key."""
    path = tmp_path / "epp.yaml"
    path.write_text(text)
    assert main(["serve", "--endpoints", "127.0.0.1:8000", "--config-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.startswith(f"picker serve: {path}: ") and "Traceback" not in err, err


def test_the_reference_vocabulary_also_works_inside_our_scheduling_section(tmp_path: Path) -> None:
    """What the issue found refused: single-profile-handler unknown, prefix-cache-scorer's blockSize a TypeError."""
    path = tmp_path / "ours.yaml"
    path.write_text("scheduling:\n  plugins:\n  - type: single-profile-handler\n  - type: prefix-cache-scorer\n"
                    "    parameters: {blockSize: 64, ratioWeight: 0.3}\n  schedulingProfiles:\n"
                    "  - name: only\n    plugins: [{pluginRef: prefix-cache-scorer, weight: 4}]\n")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    config = resolve(parser.parse_args(["--endpoints", "127.0.0.1:8000", "--config-file", str(path)]))
    assert profiles_of(config) == {"only": ([], {"prefix-cache-scorer": 4}, "MaxScorePicker")}
    assert config.scheduling.prefix_cache.default_block_chars == 64


def test_the_charts_args_and_default_config_route_through_envoy(tmp_path: Path) -> None:
    """The reference chart's container args (its --grpc-health-port aside: the test picks free ports) and its
    default config, unchanged, against an InferencePool: requests route, Explain shows the profile the config
    describes with its weights, and the one flag that changes nothing here (--tracing) is one JSON warning."""
    port = free_port()
    pods = {"vllm-0": "127.0.0.2", "vllm-1": "127.0.0.3"}
    addresses = [f"{ip}:{port}" for ip in pods.values()]
    thread = FakeKubeThread()
    with thread as kube, process_scope("reference-chart") as (logdir, started):
        backends = spawn("pods", [sys.executable, "-m", "picker_lab.echo", *addresses], logdir)
        started.append(backends)
        for address in addresses:
            wait_until(lambda a=address: _bound(a), 20, f"pod {address}", backends.proc)  # type: ignore[misc]
        thread.run(kube.put_pool(NS, "vllm-llama3", LABELS, [port]))
        for name, ip in pods.items():
            thread.run(kube.put_pod(NS, name, ip, LABELS))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kube.kubeconfig(namespace=NS))
        chart_args = ["--pool-name", "vllm-llama3", "--pool-namespace", NS, "--pool-group",
                      "inference.networking.k8s.io", "--zap-encoder", "json", "--config-file",
                      str(CONFIGS / "chart-default.yaml"), "--tracing=false"]
        picker = start_picker(logdir, extra=[*chart_args, "--kubeconfig", str(kubeconfig)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, addresses)
        started.append(envoy.process)
        served = {_served_by(envoy, f"question {i} " * 40) for i in range(6)}
        assert served <= set(addresses) and served
        body = json.dumps({"model": "tiny", "prompt": "question 1 " * 40})
        explained = subprocess.run([sys.executable, "-m", "picker", "explain", "--target", picker.target,
                                    "--plaintext", "--path", "/v1/completions", "--body", body, "--json"],
                                   capture_output=True, text=True, timeout=30, check=True)
        result = json.loads(explained.stdout)
        assert result["profile"] == "default" and result["error"] is None
        weights = {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
        for candidate in result["candidates"]:
            assert set(candidate["scores"]) == set(weights)
            expected = sum(weights[name] * score for name, score in candidate["scores"].items())
            assert candidate["total"] == pytest.approx(expected, abs=1e-3)
        entries = [json.loads(line) for line in picker.process.log().splitlines() if line.startswith("{")]
        warned = sorted(e["msg"].split("=", 1)[0] for e in entries if e["level"] == "warning")
        assert warned == ["reference picker flag --tracing"], warned
