"""`picker demo --once` brings up Envoy, a simulated fleet and the picker, routes the samples and cleans up."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_end_to_end() -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "demo", "--once", "--pods", "2"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert out.count("-> 200 served by 127.0.0.1:") == 5, out
    assert "-> 400" in out and "invalid_json" in out
    assert "-> 404" in out and "unknown_path" in out
    # The second request shares the first one's system prompt: the index must see the shared blocks.
    second = out.split("[2] ", 1)[1].split("[3] ", 1)[0]
    matched = second.split("prefix blocks matched: ", 1)[1].split("/", 1)[0]
    assert int(matched) > 0, second


def test_demo_with_two_replicas_sharing_the_index() -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "demo", "--once", "--pods", "3", "--replicas", "2"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert "prefix index shared by 2 picker replicas" in out and out.count("  picker: 127.0.0.1") == 2, out
    served = [line.split("served by ", 1)[1].split()[0] for line in out.splitlines() if "-> 200 served by" in line]
    assert len(served) == 5, out
    # Envoy alternates replicas: the same system prompt still lands on one pod, whichever replica routes it.
    assert served[0] == served[1] == served[2], out
