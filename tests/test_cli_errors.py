"""Every subcommand answers a bad argument with one line naming it and exit status 2, before anything starts:
never a Python traceback, never a run that goes wrong later."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from picker.cli import SUBCOMMANDS, main
from picker.core.children import ProcessExited
from picker_lab.supervisor import free_port

BAD: dict[str, tuple[list[str], str]] = {
    # subcommand: (arguments, what the last line of stderr says)
    "serve": (["--endpoints", "127.0.0.1:99999"], "bad port '99999'"),
    "demo": (["--pods", "0"], "argument --pods: must be from 1 to 64, not 0"),
    "envoy-config": (["--listen-port", "99999"], "argument --listen-port: must be from 1 to 65535, not 99999"),
    "explain": (["--target", "nonsense", "--endpoints"], "argument --target: 'nonsense' is not host:port"),
    "doctor": (["--envoy-admin", f"http://127.0.0.1:{free_port()}"], "cannot read Envoy's admin interface"),
    "pd-sidecar": (["--port", "99999"], "argument --port: must be from 1 to 65535, not 99999"),
    "sim": (["--time-scale", "0"], "argument --time-scale: must be above 0, not 0"),
    "bench": (["--pods", "0"], "argument --pods: must be at least 1, not 0"),
}


def test_every_subcommand_is_covered() -> None:
    assert set(BAD) == set(SUBCOMMANDS)


@pytest.mark.parametrize("command", list(BAD))
def test_a_bad_argument_is_one_line_and_status_2(command: str) -> None:
    args, said = BAD[command]
    result = subprocess.run([sys.executable, "-m", "picker", command, *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert said in result.stderr.strip().splitlines()[-1], result.stderr


def test_a_dead_child_of_any_command_is_told_without_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark starts pickers, Envoys and pods as the demo does: one that dies is named with its cause."""
    from picker_lab.bench import cli as bench_cli

    def dies(args: object) -> int:
        raise ProcessExited("envoy", 1, "starting\nerror initializing configuration: bad thing", Path("envoy.log"))

    monkeypatch.setattr(bench_cli, "run", dies)
    assert main(["bench", "--mode", "fast"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("picker bench: envoy exited with status 1 while starting: error initializing "
                          "configuration: bad thing\n  its last log lines (envoy.log):") and "Traceback" not in err
