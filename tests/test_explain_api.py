"""The picker.v1 API (Explain, ListEndpoints) and the `picker explain` CLI against a running picker."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import Stack

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "why here?"}]})


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker", "explain", "--target",
                           f"127.0.0.1:{stack.picker.grpc_port}", "--plaintext", *args], capture_output=True, text=True, timeout=30)


def test_explain_ranks_every_pool_endpoint(stack: Stack) -> None:
    result = cli(stack, "--body", BODY, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data["ranked"]) == set(stack.backends.addresses)
    assert {c["address"] for c in data["candidates"]} == set(stack.backends.addresses)
    assert all(c["scores"] for c in data["candidates"])
    # the weights behind each total, and why the profile was chosen
    for c in data["candidates"]:
        assert abs(sum(data["weights"][name] * score for name, score in c["scores"].items()) - c["total"]) < 1e-9
    assert data["profile"] == "bursty-chat" and data["profile_reason"].startswith("no pod holds any of this prompt")
    table = cli(stack, "--body", BODY)
    assert table.returncode == 0 and "pick: 127.0.0.1:" in table.stdout
    assert "why bursty-chat: " in table.stdout and "x weight" in table.stdout


def test_explain_reports_refusals(stack: Stack) -> None:
    result = cli(stack, "--body", "{broken")
    assert result.returncode == 3  # the picker would refuse it: a script can tell
    assert "refused: 400 invalid_json" in result.stdout


def test_list_endpoints(stack: Stack) -> None:
    result = cli(stack, "--endpoints", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert {e["address"] for e in listed} == set(stack.backends.addresses)


def test_explain_against_a_dead_target_is_a_clear_error() -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "explain", "--target", "127.0.0.1:1", "--plaintext",
                             "--body", BODY], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
    result = subprocess.run([sys.executable, "-m", "picker", "explain", "--target", "127.0.0.1:1", "--body", BODY],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stderr.startswith("picker explain: 127.0.0.1:1: "), result.stderr


def test_explain_over_tls_to_a_plaintext_picker_says_so(stack: Stack) -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "explain", "--target",
                             f"127.0.0.1:{stack.picker.grpc_port}", "--endpoints"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "--secure-serving=false needs --plaintext" in result.stderr, result.stderr


def test_explain_lists_a_prompts_media(stack: Stack) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://images.example/vase.png"}}
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [image]}]})
    table = cli(stack, "--body", body)
    assert table.returncode == 0, table.stderr
    assert "media: image " in table.stdout and "(391 tokens, by url)" in table.stdout
    data = json.loads(cli(stack, "--body", body, "--json").stdout)
    assert [(m["kind"], m["tokens"]) for m in data["media"]] == [("image", 391)]
