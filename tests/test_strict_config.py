"""`picker serve --config-file`: an unknown key or a wrong type anywhere stops start-up with the key's path."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from picker.cli import main
from picker.serving import config as cfg

pytestmark = pytest.mark.timeout(30)  # a config that wrongly passes would start serving: fail fast

BASE = "endpoints: 10.0.0.1:8000\n"

CASES = [
    ("top-level unknown key", "grpc-prot: 9002\n", "grpc-prot: unknown key (did you mean grpc-port?)"),
    ("top-level unknown key, underscores", "log_levl: debug\n", "log_levl: unknown key (did you mean log_level?)"),
    ("nested unknown key, camelCase", "admission:\n  flowControl: {queueTl: 4s}\n",
     "admission.flowControl.queueTl: unknown key (did you mean queueTtl?)"),
    ("broken YAML", "admission: [1\n", "line 3, column 1: expected ',' or ']', but got '<stream end>'"),
    ("top-level wrong type", "grpc-port: abc\n", "grpc-port: Input should be a valid integer"),
    ("top-level bad duration", "metrics-slow-interval: '5'\n", "metrics-slow-interval: '5' needs a unit"),
    ("top-level bad choice", "strategy: fastest\n", "strategy: Input should be 'picker'"),
    ("admission unknown key", "admission:\n  maxwait: 1s\n", "admission.maxwait: unknown key"),
    ("admission wrong type", "admission:\n  queueThreshold: many\n", "admission.queueThreshold: Input should be"),
    ("admission objective priority", "admission:\n  objectives: {chat: high}\n", "admission.objectives.chat: "),
    ("scheduling unknown key", "scheduling:\n  schedulingprofiles: []\n",
     "scheduling.schedulingprofiles: unknown key"),
    ("scheduling nested unknown key", "scheduling:\n  prefixCache: {ttl: 60}\n",
     "scheduling.prefixCache.ttl: unknown key"),
    ("scheduling wrong type", "scheduling:\n  prefixCache: {lruCapacityPerServer: lots}\n",
     "scheduling.prefixCache.lruCapacityPerServer: Input should be a valid integer"),
    ("plugin parameter", "scheduling:\n  plugins:\n  - {type: queue-scorer, parameters: {weight: 2}}\n",
     "scheduling.plugins[0].parameters.weight: unknown key"),
    ("plugin type", "scheduling:\n  plugins:\n  - {type: subset-filter}\n",
     "scheduling.plugins[0].type: unknown plugin type 'subset-filter'"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in CASES], ids=[c[0] for c in CASES])
def test_bad_config_exits_non_zero_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                  message: str) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(BASE + text)
    assert main(["serve", "--config-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.startswith(f"picker serve: {path}: "), err


def test_a_bad_file_value_is_an_error_even_when_a_flag_sets_the_key(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(BASE + "grpc-port: abc\n")
    assert main(["serve", "--config-file", str(path), "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"picker serve: {path}: grpc-port: Input should be a valid integer"), err


def test_the_process_exits_non_zero(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(BASE + "scheduling:\n  prefixCache: {ttl: 60}\n")
    done = subprocess.run([sys.executable, "-m", "picker", "serve", "--config-file", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "scheduling.prefixCache.ttl: unknown key" in done.stderr, done.stderr


def test_a_good_config_decodes_every_section(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(BASE + "grpc_port: 7000\nadmission: {kvCacheThreshold: 0.9, maxWait: 250ms}\n"
                    "scheduling:\n  apiVersion: inference.networking.x-k8s.io/v1alpha1\n"
                    "  kind: EndpointPickerConfig\n  prefixCache: {charsPerToken: 3}\n")
    config = cfg.resolve(argparse.Namespace(config_file=str(path)))
    assert config.grpc_port == 7000 and config.admission.max_wait == 0.25
    assert config.admission.thresholds.kv_cache == 0.9 and config.scheduling.prefix_cache.chars_per_token == 3



def test_log_level_is_a_choice_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--endpoints", "10.0.0.1:8000", "--log-level", "verbose"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log-level: invalid choice: 'VERBOSE'" in err and "usage: picker serve" in err


def test_the_start_up_line_says_metrics_off(tmp_path: Path) -> None:
    """`--metrics-port -1`: no Prometheus server, and the start-up line says so (not "metrics on 0")."""
    from picker_lab.supervisor import free_port

    args = [sys.executable, "-m", "picker", "serve", "--host", "127.0.0.1", "--endpoints", "127.0.0.1:1",
            "--grpc-port", str(free_port()), "--grpc-health-port", str(free_port()), "--metrics-port", "-1",
            "--log-level", "info"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stderr is not None
            line = ""
            while "ext_proc on" not in line:  # logged once every server listens
                line = proc.stderr.readline()
                assert line, "the picker exited before its start-up line"
            assert "metrics off" in line and "metrics on" not in line, line
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_missing_endpoints_file_is_a_start_up_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "pool.yaml"
    assert main(["serve", "--endpoints-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"picker serve: --endpoints-file {missing}: no such file"), err


def test_nothing_close_gets_no_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(BASE + "colour: blue\n")
    assert main(["serve", "--config-file", str(path)]) == 2
    assert capsys.readouterr().err.rstrip().endswith("colour: unknown key")


@pytest.mark.parametrize(("text", "said"), [
    ("- {addr: '127.0.0.1:8000'}\n", "bad endpoint entry {'addr': '127.0.0.1:8000'}: each entry is \"host:port\" (an "
                                     "IP or a name), or {address: \"host:port\""),
    ("- 127.0.0.1:99999\n", "endpoint '127.0.0.1:99999': bad port '99999'"),
    ("endpoints: [127.0.0.1:8000\n", "line 2, column 1: expected ',' or ']'"),
    ("just text\n", "expected a list of endpoints (each entry is"),
])
def test_a_bad_endpoints_file_at_start_up_exits_2_showing_the_valid_form(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str) -> None:
    path = tmp_path / "ep.yaml"
    path.write_text(text)
    assert main(["serve", "--endpoints-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"picker serve: --endpoints-file {path}") and said in err and "Traceback" not in err, err
