"""Debug logging that helps an operator: one line per decision, no library internals, every line in the chosen
encoder (JSON from the first line)."""

from __future__ import annotations

import json
import urllib.request

from picker_lab.supervisor import process_scope, start_backends, start_envoy, start_picker


def _complete(url: str, prompt: str) -> int:
    body = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def test_debug_run_logs_one_json_line_per_decision_and_no_grpc_internals() -> None:
    with process_scope("debug-log") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, extra=["--v=4", "--zap-encoder", "json"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses)
        started.append(envoy.process)
        assert [_complete(envoy.url, f"decision {i} " * 50) for i in range(3)] == [200] * 3
        picker.process.stop()
        entries = [json.loads(line) for line in picker.process.log().splitlines() if line]  # every line
    assert any(e["msg"].startswith("picker: ext_proc on") for e in entries), entries  # the start-up line too
    decisions = [e for e in entries if e["level"] == "debug" and e["msg"].startswith("routed ")]
    assert len(decisions) == 3, [e["msg"] for e in entries]
    for line in decisions:
        assert "model=tiny" in line["msg"] and "profile=" in line["msg"] and "prefix=" in line["msg"]
        assert any(address in line["msg"] for address in backends.addresses)
    internals = [e for e in entries if not e["logger"].startswith("picker") and e["level"] == "debug"]
    assert internals == [], internals
    assert all("cygrpc" not in e["msg"] for e in entries)


def test_an_exit_error_follows_the_log_format() -> None:
    from picker.core.logformat import exit_line

    assert exit_line("picker serve: --grpc-port 1: address already in use") == \
        "picker serve: --grpc-port 1: address already in use"
    entry = json.loads(exit_line("picker serve: boom", "json"))
    assert (entry["level"], entry["logger"], entry["msg"]) == ("error", "picker", "picker serve: boom")
