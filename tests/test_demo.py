"""`picker demo --once` brings up Envoy, a simulated fleet and the picker, routes the samples and cleans up."""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from picker_lab import demo
from picker_lab.supervisor import ProcessExited, process_scope, start_picker


def run_demo(tmp_path: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The demo as `make demo` runs it (the installed `picker` script), with its temporary folders in tmp_path so
    leftovers can be seen."""
    return subprocess.run([str(Path(sys.executable).parent / "picker"), "demo", *args], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=cwd)


def blocks(out: str) -> dict[int, str]:
    """Sample number → what the demo printed for it."""
    parts = out.split("\n[")[1:]
    return {int(p.split("]", 1)[0]): p for p in parts}


def check_pick_matches_served(block: str) -> str | None:
    """The pod that served a request is Explain's pick, one of the endpoints it names as tied, or the difference
    is said; None when consistent."""
    lines = block.splitlines()
    served_line = next((line for line in lines if "-> 200 served by " in line), None)
    pick_line = next((line for line in lines if line.strip().startswith("pick: ")), None)
    if served_line is None or pick_line is None:
        return None
    served = served_line.split("served by ", 1)[1].split()[0].rstrip(",")
    pick = pick_line.strip().removeprefix("pick: ").split("   ", 1)[0]
    if pick.startswith("tie of "):
        tied = pick.split("(", 1)[1].rstrip(")").split(", ")
        if served in tied and "tie-break" in served_line:
            return None
    elif served == pick and "(" not in served_line:
        return None
    if f"not Explain's pick {pick}" in served_line:  # said in so many words: honest, if rare
        return None
    return f"pick {pick!r} vs {served_line.strip()!r}"


# Every demo run the tests make: test_every_demo_option_the_readme_lists_runs_in_a_test checks they cover the
# README's list of `make demo ARGS=...` options.
DEFAULT_RUN = ("--once", "--pods", "2")
REPLICAS_RUN = ("--once", "--pods", "3", "--replicas", "2", "--tls")
ECHO_RUN = ("--once", "--pods", "2", "--backend", "echo", "--mode", "full-duplex")
ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    result = run_demo(tmp_path, *DEFAULT_RUN)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert out.count("-> 200 served by 127.0.0.1:") == 5, out
    assert "-> 200 answered by the picker: " in out, out  # GET /v1/models: the pool's union
    assert "-> 400" in out and "invalid_json" in out
    assert "-> 404" in out and "unknown_path" in out and " …\n" in out  # cut at a word, and says so
    # the weights behind each total and why each profile was chosen
    assert out.count("  x weight  ") == 4 and "why bursty-chat: no pod holds any of this prompt yet" in out, out
    assert "why context-heavy: one pod alone holds " in out, out
    # the burst: spread over both pods by load, the rest queued, a sheddable request shed
    burst = blocks(out)[9]
    served = burst.split("-> 12 x 200; served by ", 1)[1].split("\n", 1)[0]
    assert len(served.split(", ")) == 2, burst  # both pods, though one holds the shared prefix
    queued = int(burst.split("-> ", 2)[2].split(" of 12 waited", 1)[0])
    assert queued > 0, burst
    assert "while the pool was full: 429 saturated (x-llm-d-request-dropped-reason: rejected-saturated)" in burst
    # The second request shares the first one's system prompt: the index must see the shared blocks.
    by_sample = blocks(out)
    matched = by_sample[2].split("prefix blocks matched: ", 1)[1].split("/", 1)[0]
    assert int(matched) > 0, by_sample[2]
    # The first request is cold: every pod ties, and the demo says so rather than naming one of them.
    assert "pick: tie of 2 at " in by_sample[1], by_sample[1]
    assert [p for p in map(check_pick_matches_served, by_sample.values()) if p] == [], out
    # A successful run leaves no log folder behind.
    assert list(tmp_path.glob("picker-demo-*")) == [], "picker demo left its logs behind"


def test_pick_and_served_checker_catches_a_disagreement() -> None:
    pick = "    pick: 127.0.0.1:1   profile: p   priority: 0   prefix blocks matched: 0/1\n"
    assert check_pick_matches_served(pick + "    -> 200 served by 127.0.0.1:1\n") is None
    assert check_pick_matches_served(pick + "    -> 200 served by 127.0.0.1:2\n")
    tie = "    pick: tie of 2 at 8.000 (127.0.0.1:1, 127.0.0.1:2)   profile: p\n"
    assert check_pick_matches_served(tie + "    -> 200 served by 127.0.0.1:2 (one of the 2 tied: ... tie-break)\n") \
        is None
    assert check_pick_matches_served(tie + "    -> 200 served by 127.0.0.1:3 (... tie-break)\n")


def test_demo_with_two_replicas_sharing_the_index(tmp_path: Path) -> None:
    # Over mTLS: both replicas serve certificates of one throwaway CA, Envoy presents its client certificate.
    result = run_demo(tmp_path, *REPLICAS_RUN)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert "prefix index shared by 2 picker replicas" in out and out.count("  picker: 127.0.0.1") == 2, out
    deciders = {line.split("decided by replica ", 1)[1] for line in out.splitlines() if "decided by replica" in line}
    assert deciders == {"127.0.0.10", "127.0.0.11"}, out  # Envoy alternates replicas; each says it decided
    assert out.count("(mTLS, certificates in ") == 2, out
    served = [line.split("served by ", 1)[1].split()[0].rstrip(",") for line in out.splitlines()
              if "-> 200 served by" in line]
    assert len(served) == 5, out
    # Envoy alternates replicas: the same system prompt still lands on one pod, whichever replica routes it.
    assert served[0] == served[1] == served[2], out
    assert [p for p in map(check_pick_matches_served, blocks(out).values()) if p] == [], out
    assert list(tmp_path.glob("picker-demo-*")) == []


def test_demo_with_echo_backends_in_full_duplex_mode_from_the_folder_holding_a_clone(tmp_path: Path) -> None:
    """Run where a folder named `picker` (a clone) sits in the working directory: every child still runs the
    installed package, not that folder."""
    holder = tmp_path / "projects"
    (holder / "picker" / "picker").mkdir(parents=True)
    (holder / "picker" / "README.md").write_text("a clone\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = run_demo(temp, *ECHO_RUN, cwd=holder)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert "(full-duplex body mode)" in out and out.count("-> 200 served by 127.0.0.1:") == 5, out
    assert "model_not_found" not in out and "burst: skipped with --backend echo" in out, out
    assert list(temp.iterdir()) == []


def test_every_demo_option_the_readme_lists_runs_in_a_test() -> None:
    readme = (ROOT / "README.md").read_text().replace("\n", " ")
    listed = readme.split("Options through `ARGS`:", 1)[1].split(".", 1)[0]
    options = [part.split("`")[0].split() for part in listed.split("`")[1::2]]
    assert len(options) >= 6, listed
    runs = [DEFAULT_RUN, REPLICAS_RUN, ECHO_RUN]
    for option in options:
        flag, value = option[0], option[1:]
        assert any(flag in run and (not value or value[0] == "N" or run[run.index(flag) + 1] == value[0])
                   for run in runs), f"README's `make demo` option {' '.join(option)} is not run by a test"


def _read_until(lines: queue.Queue[str | None], marker: str, timeout: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not seen or marker not in seen[-1]:
        line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        if line is None:
            raise AssertionError("demo exited early:\n" + "".join(seen))
        seen.append(line)
    return seen


def test_printed_commands_work_as_printed(tmp_path: Path) -> None:
    """Interactive mode: the suggested curl answers briefly (max_tokens), both `picker explain` commands run as
    printed from another directory (over mTLS: they carry the CA and client certificate), and SIGTERM stops
    everything and removes the log folder."""
    proc = subprocess.Popen([sys.executable, "-m", "picker", "demo", "--pods", "2", "--tls"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        out = _read_until(lines, "Ctrl-C stops everything.", 120)
        commands = [shlex.split(line) for line in out if line.startswith("  ") and
                    (line.lstrip().startswith("curl ") or " explain --target " in line)]
        curl = next(c for c in commands if c[0] == "curl")
        body = curl[curl.index("-d") + 1]
        assert curl[1] == "-si"
        assert json.loads(body)["max_tokens"] <= 64
        if shutil.which("curl"):
            printed = subprocess.run(curl, capture_output=True, text=True, timeout=60, check=True).stdout
            head, answer = printed.replace("\r\n", "\n").split("\n\n", 1)  # -i: the headers first
            served_by = [line.split(":", 1)[1].strip() for line in head.splitlines()
                         if line.lower().startswith("x-served-by:")]
            assert served_by and served_by[0].startswith("127.0.0.1:"), head  # the pod's address, for the client
        else:
            request = urllib.request.Request(curl[2], data=body.encode(), headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = response.read().decode()
        assert json.loads(answer)["choices"] and len(answer) < 4000, answer[:500]
        explains = [c for c in commands if c[0] != "curl"]
        assert len(explains) == 2
        for command in explains:
            assert Path(command[0]).is_absolute(), command
            result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert result.returncode == 0 and "127.0.0.1:" in result.stdout, result.stdout + result.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert list(tmp_path.glob("picker-demo-*")) == []


def test_a_child_that_dies_is_named_with_its_last_log_lines_and_its_logs_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with process_scope("dying") as (logdir, started), pytest.raises(ProcessExited) as dead:
        # a real child that refuses its arguments
        started.append(start_picker(logdir, endpoints=["127.0.0.1:1"], extra=["--refresh-metrics-interval",
                                                                                "soon"]).process)
    assert dead.value.returncode == 2 and "refresh-metrics-interval" in dead.value.cause, dead.value.log_tail

    def dying_fleet(*args: object, **kwargs: object) -> None:
        raise dead.value

    monkeypatch.setattr(demo, "start_sim", dying_fleet)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--once"])) == 1
    err = capsys.readouterr().err
    (kept,) = tmp_path.glob("picker-demo-*")
    assert f"picker: process exited with status 2 while starting: {dead.value.cause}" not in err
    assert err.startswith(f"picker demo: picker exited with status 2 while starting: {dead.value.cause}\n"), err
    assert "its last log lines (" in err and f"logs kept in {kept}" in err and "Traceback" not in err


def test_bad_counts_are_refused_before_anything_starts(tmp_path: Path) -> None:
    for args, said in ((["--pods", "0"], "argument --pods: must be from 1 to 64, not 0"),
                       (["--replicas", "many"], "argument --replicas: 'many' is not a whole number")):
        result = run_demo(tmp_path, "--once", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1] == f"picker demo: error: {said}"  # after the usage
    assert list(tmp_path.iterdir()) == []  # no log folder: nothing was started


def test_help_shows_every_default() -> None:
    parser = argparse.ArgumentParser(prog="picker demo")
    demo.add_arguments(parser)
    for action in parser._actions:
        if action.default in (None, False, argparse.SUPPRESS):
            continue
        assert action.help and ("%(default)s" in action.help or f"default {action.default}" in action.help), \
            action.option_strings
    text = " ".join(parser.format_help().split())
    assert "(default meta-llama/Llama-3.1-8B-Instruct)" in text and "(default buffered)" in text
