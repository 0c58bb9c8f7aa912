"""A port that is already taken: `picker serve` and `picker sim` say which flag and port in one line, exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process (this test) is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def picker(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `picker ARGS` as a user types it; a command that hangs instead of failing fails the test."""
    return subprocess.run([sys.executable, "-m", "picker", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr == expected + "\n"  # nothing else: no traceback, no unclosed-session warning
    assert result.stdout == ""


@pytest.mark.parametrize("flag", ["--grpc-port", "--grpc-health-port", "--metrics-port"])
def test_serve_names_the_taken_port(taken_port: int, flag: str) -> None:
    ports = {"--grpc-port": "0", "--grpc-health-port": "0", "--metrics-port": "0", flag: str(taken_port)}
    result = picker("serve", "--host", "127.0.0.1", "--endpoints", "127.0.0.1:1",
                    *(part for item in ports.items() for part in item))
    assert_one_line_error(result, f"picker serve: {flag} {taken_port}: address already in use")


def test_serve_refuses_one_port_for_two_servers() -> None:
    with socket.socket() as probe:  # a port that is free right now
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    result = picker("serve", "--host", "127.0.0.1", "--endpoints", "127.0.0.1:1", "--grpc-port", port,
                    "--grpc-health-port", port, "--metrics-port", "-1")
    assert_one_line_error(result, f"picker serve: --grpc-health-port {port}: address already in use")


def test_sim_names_the_base_port(taken_port: int) -> None:
    result = picker("sim", "--pods", "1", "--base-port", str(taken_port))
    assert_one_line_error(result, f"picker sim: --base-port {taken_port}: address already in use")


def test_sim_names_the_pod_whose_port_is_taken(taken_port: int) -> None:
    # Pod 0 gets the free port below the taken one (if that one is taken too, pod 0 is reported instead).
    base = taken_port - 1
    result = picker("sim", "--pods", "2", "--base-port", str(base))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr in (f"picker sim: --base-port {base}: port {taken_port} (sim-1): address already in use\n",
                             f"picker sim: --base-port {base}: address already in use\n")
