"""A Deployment of the reference endpoint picker (GIE's, now llm-d's router) runs unchanged: its usual args are
accepted, the ones that map onto ours take effect, each of the others is one warning; through real Envoy."""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import pytest

from picker.endpoints.state import Endpoint
from picker.serving import reference_flags
from picker.serving.config import ConfigError, add_arguments, resolve
from picker_lab.supervisor import process_scope, start_backends, start_envoy, start_picker

ROOT = Path(__file__).resolve().parent.parent
# The args the issue found stopping `picker serve` with "unrecognized arguments".
REFERENCE_ARGS = ["--v=2", "--zap-encoder", "json", "--secure-serving=false", "--pool-group",
                  "inference.networking.k8s.io", "--config-text", "metrics-slow-interval: 2s\n",
                  "--model-server-metrics-path", "/metrics", "--model-server-metrics-scheme", "http",
                  "--ha-enable-leader-election", "--drain-timeout=1s"]  # (--model-server-metrics-port: test_scraper)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return parser.parse_args(["--endpoints", "127.0.0.1:8000", *argv])


def test_the_reference_args_parse_and_map() -> None:
    args = parse(*REFERENCE_ARGS)
    config = resolve(args)
    assert config.log_format == "json" and config.log_level == "INFO" and not config.secure_serving
    assert config.metrics_slow_interval == 2.0 and config.drain_timeout == 1.0  # --config-text, --drain-timeout
    warned = reference_flags.notes(reference_flags.given(args), config.index_backend)
    assert [n.split("=", 1)[0] for n in warned] == ["--ha-enable-leader-election"]
    assert "each keeps its own prefix index" in warned[0] and "--index-backend redis" in warned[0]  # memory index
    shared = reference_flags.notes(reference_flags.given(args), "redis")
    assert "shared through Redis" in shared[0] and "own prefix index" not in shared[0]
    assert config.pool_group == "inference.networking.k8s.io"  # ours now: the InferencePool's API group
    assert config.metrics_target.url(Endpoint.from_address("10.0.0.1:8000")) == "http://10.0.0.1:8000/metrics"
    target = resolve(parse("--model-server-metrics-port", "9400", "--model-server-metrics-scheme", "https",
                           "--model-server-metrics-path", "/stats")).metrics_target
    assert target.url(Endpoint.from_address("10.0.0.1:8000")) == "https://10.0.0.1:9400/stats" and not target.verify_tls
    assert resolve(parse("-v", "4")).log_level == "DEBUG" and resolve(parse("--zap-log-level", "error")).log_level \
        == "ERROR"
    assert resolve(parse("--v=5", "--log-level", "warning")).log_level == "WARNING"  # our own flag wins


@pytest.mark.parametrize("argv,message", [
    (["-v", "lots"], "-v 'lots'"),
    (["--zap-encoder", "xml"], "--zap-encoder 'xml'"),
    (["--zap-log-level", "loud"], "--zap-log-level 'loud'"),
    (["--config-text", "grpc-prot: 1"], "grpc-prot: unknown key"),
    (["--config-text", "x: 1", "--config-file", "/dev/null"], "not both"),
    (["--model-server-metrics-path", "metrics"], "model_server_metrics_path|model-server-metrics-path"),
])
def test_bad_reference_values_name_their_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(parse(*argv))


def test_the_readme_table_is_the_declared_one() -> None:
    assert reference_flags.readme_table() in (ROOT / "docs" / "configuration.md").read_text()


def test_a_reference_deployments_args_run_through_envoy() -> None:
    with process_scope("reference-args") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=REFERENCE_ARGS)
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses)
        started.append(envoy.process)
        body = json.dumps({"model": "tiny", "prompt": "drop-in"}).encode()
        request = urllib.request.Request(f"{envoy.url}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        entries = [json.loads(line) for line in picker.process.log().splitlines()]  # JSON from the first line
        warnings = [e["msg"] for e in entries if e["level"] == "warning" and "reference picker flag" in e["msg"]]
        assert len(warnings) == 1 and "--ha-enable-leader-election" in warnings[0], warnings
