"""Cache tiers through real Envoy: a pod that offloads its KV cache to host memory (the simulator's CPU tier, as
vLLM's OffloadingConnector) keeps a long prefix there after its device evicted it; its KV events tell the picker
which medium holds what, so a request with that prefix goes to that pod, where it is loaded instead of computed,
and Explain and the picker's metrics show the blocks held by host memory only."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker_lab.bench.workloads import WORDS
from picker_lab.supervisor import (
    Picker,
    process_scope,
    start_envoy,
    start_picker,
    wait_until,
)
from tests.test_precise_envoy import PublishingStack, start_publishing_pods

# 79 usable device blocks of 16 tokens, 512 in host memory: three ~40-block prompts push a fourth out of the device
SERVED_BY = "x-served-by"  # the pod that answered, as Envoy names it
SIM_FLAGS = ["--profile", "tiny-cpu", "--block-size", "16", "--time-scale", "20", "--num-gpu-blocks", "80",
             "--num-cpu-blocks", "512"]


@pytest.fixture(scope="module")
def stack() -> Iterator[PublishingStack]:
    with process_scope("cache-tiers") as (logdir, started):
        pods, endpoint, replay = start_publishing_pods(logdir, started, SIM_FLAGS, first_host=30)
        addresses = [a for p in pods for a in p.addresses]
        picker = start_picker(logdir, endpoints=addresses, extra=[
            "--kv-events-endpoint", endpoint, "--kv-events-replay-port", str(replay)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, addresses, served_by=SERVED_BY)
        started.append(envoy.process)
        yield PublishingStack(pods, picker, envoy)


def complete(url: str, prompt: str) -> tuple[dict[str, int], str]:
    """The usage (prompt and cached tokens) and the pod that answered (through Envoy; "" sent directly)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        usage = json.loads(response.read())["usage"]
        served_by = response.headers.get(SERVED_BY, "")
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}, served_by


def medium_blocks(picker: Picker) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://{picker.host}:{picker.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.labels["model_server_endpoint"], s.labels["medium"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "picker_precise_medium_blocks"}


def explained(picker: Picker, prompt: str) -> dict[str, tuple[float, float]]:
    """Explain's view of the prompt: per candidate, the tokens it holds in host memory only and its prefix score."""
    with grpc.insecure_channel(picker.target) as channel:
        answer = picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
            path="/v1/completions", body=json.dumps({"model": "tiny", "prompt": prompt}).encode()))
    return {c.address: (c.details.get("prefix.offloaded_tokens", 0.0), c.scores["prefix-cache-scorer"])
            for c in answer.candidates}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_a_prefix_only_host_memory_holds_goes_to_that_pod_and_is_loaded(stack: PublishingStack) -> None:
    rng = random.Random(11)
    home = stack.addresses[0]
    prefix = text(rng, 600)  # ~40 blocks
    # until the home pod's publisher reached the picker (its events before that are lost, and a tier's hash-only
    # stores key only blocks the picker heard stored on the device)
    wait_until(lambda: bool(complete(f"http://{home}", text(rng, 40))) and medium_blocks(stack.picker).get(
        (home, "GPU"), 0) > 0, 20, "the home pod's KV events in the picker's view", stack.picker.process.proc)
    complete(f"http://{home}", prefix + " warm-up")
    for i in range(3):  # other long prompts push all of it out of the device; host memory keeps it
        complete(f"http://{home}", text(rng, 600) + f" other {i}")
    probe = prefix + " question"
    wait_until(lambda: explained(stack.picker, probe).get(home, (0.0, 0.0))[0] >= 30 * 16, 20,
               "the home pod's host-memory blocks in the picker's view", stack.picker.process.proc)
    blocks = medium_blocks(stack.picker)
    assert blocks[(home, "CPU")] >= 4 * 30 and blocks[(home, "GPU")] <= 79
    (other,) = set(stack.addresses) - {home}
    view = explained(stack.picker, probe)
    assert view[home][1] > 0.5 and view[other] == (0.0, 0.0), view  # its prefix is in host memory only
    for i in range(4):
        usage, served_by = complete(stack.envoy.url, prefix + f" question {i}")
        assert served_by == home, (i, served_by)
        # loaded from host memory: counted as cached by the pod (a cold pod would compute all of it)
        assert usage["cached"] >= 0.8 * (usage["prompt"] - 16), usage
