"""A benchmark stopped with `kill` (SIGTERM) stops the processes it started instead of orphaning them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from picker_lab.supervisor import KEEP_LOGS_ENV, process_scope

SCOPE = """
import sys, time
from picker_lab.supervisor import process_scope, spawn
with process_scope("sigterm-test") as (logdir, started):
    started.append(spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], logdir))
    print(started[0].proc.pid, flush=True)
    time.sleep(600)
"""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sigterm_stops_what_the_scope_started(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", SCOPE], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 128 + signal.SIGTERM
        assert not _exists(child)  # stopped and reaped by the scope before the parent exited
        assert [p.name for p in tmp_path.glob("picker-sigterm-test-*/*")] == ["sleeper.log"]  # stopped: kept
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and _exists(child):
            os.kill(child, signal.SIGKILL)


def test_a_scope_that_ends_well_removes_its_logs_and_one_that_fails_keeps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv(KEEP_LOGS_ENV, raising=False)
    with process_scope("fine") as (logdir, _):
        (logdir / "a.log").write_text("ok")
    assert not logdir.exists()
    with pytest.raises(RuntimeError), process_scope("broken") as (logdir, _):
        raise RuntimeError("a child died")
    assert logdir.is_dir()
    monkeypatch.setenv(KEEP_LOGS_ENV, "1")
    with process_scope("asked") as (logdir, _):
        pass
    assert logdir.is_dir()
