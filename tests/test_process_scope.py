"""A benchmark stopped with `kill` (SIGTERM) stops the processes it started instead of orphaning them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

SCOPE = """
import sys, time
from picker.serving.supervisor import process_scope, spawn
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


def test_a_sigterm_stops_what_the_scope_started() -> None:
    parent = subprocess.Popen([sys.executable, "-c", SCOPE], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 128 + signal.SIGTERM
        assert not _exists(child)  # stopped and reaped by the scope before the parent exited
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and _exists(child):
            os.kill(child, signal.SIGKILL)
