"""`picker serve` in-process: a background job that dies stops the server instead of leaving a frozen view."""

from __future__ import annotations

import asyncio
import socket

import pytest

from picker.serving import server
from picker.serving.config import ServeConfig


async def test_a_failed_background_task_stops_serve_with_an_error(caplog: pytest.LogCaptureFixture) -> None:
    config = ServeConfig(host="127.0.0.1", grpc_port=0, grpc_health_port=0, metrics_port=-1,
                         endpoints="127.0.0.1:1")
    picker = server.PickerServer(config)
    await picker.start()
    try:
        async def discovery_bug() -> None:
            raise KeyError("spec")  # a programming error, not a network one: nothing to retry

        picker.supervise(asyncio.create_task(discovery_bug(), name="kubernetes-discovery"))
        await asyncio.wait_for(picker.failed.wait(), 5.0)
        assert "kubernetes-discovery failed, stopping" in caplog.text
    finally:
        await picker.stop()


async def test_a_cancelled_task_is_no_failure() -> None:
    config = ServeConfig(host="127.0.0.1", grpc_port=0, grpc_health_port=0, metrics_port=-1,
                         endpoints="127.0.0.1:1")
    picker = server.PickerServer(config)
    await picker.start()
    await picker.stop()  # cancels every background task
    assert not picker.failed.is_set()


def _listens(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex((host, port)) == 0


async def test_grpc_host_binds_the_ext_proc_port_alone() -> None:
    """A sidecar's ext_proc port on loopback only, its health port where the kubelet's probes reach it."""
    config = ServeConfig(host="127.0.0.3", grpc_host="127.0.0.1", grpc_port=0, grpc_health_port=0, metrics_port=-1,
                         endpoints="127.0.0.1:1", secure_serving=False)
    picker = server.PickerServer(config)
    await picker.start()
    try:
        assert _listens("127.0.0.1", picker.grpc_port) and not _listens("127.0.0.3", picker.grpc_port)
        assert _listens("127.0.0.3", picker.health_port) and not _listens("127.0.0.1", picker.health_port)
    finally:
        await picker.stop()


async def test_stop_undoes_the_parts_last_started_first_even_when_one_fails(caplog: pytest.LogCaptureFixture) -> None:
    """One life cycle: each part registers its stop as it starts; stop() runs them in reverse and a failing one
    does not keep the rest running."""
    config = ServeConfig(host="127.0.0.1", grpc_port=0, grpc_health_port=0, metrics_port=0,
                         endpoints="127.0.0.1:1", secure_serving=False)
    picker = server.PickerServer(config)
    await picker.start()
    assert _listens("127.0.0.1", picker.metrics_port)
    stopped: list[str] = []

    async def first() -> None:
        stopped.append("first")

    async def broken() -> None:
        stopped.append("broken")
        raise OSError("already gone")

    picker.on_stop("first part", first)
    picker.on_stop("broken part", broken)
    await picker.stop()
    assert stopped == ["broken", "first"]
    assert "stopping the broken part failed" in caplog.text
    assert not _listens("127.0.0.1", picker.metrics_port)  # the metrics server, registered at start, stopped too


def test_a_picker_run_under_cprofile_writes_its_profile_when_stopped(tmp_path: object) -> None:
    """How bench/overhead.py sees where the picker's time goes, with no hook in the product: the statistics are
    written when `picker serve` returns from its SIGTERM."""
    import pstats
    import signal
    from pathlib import Path

    from picker_lab.supervisor import process_scope, start_backends, start_picker

    assert isinstance(tmp_path, Path)
    with process_scope("cprofile") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, profile_to=tmp_path / "picker.prof")
        started.append(picker.process)
        picker.process.stop(signal.SIGTERM)
        assert picker.process.proc.returncode == 0
    stats = pstats.Stats(str(tmp_path / "picker.prof"))
    assert any("server.py" in filename for filename, _, _ in stats.stats)  # type: ignore[attr-defined]
