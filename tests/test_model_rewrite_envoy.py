"""Model rewrites through real Envoy, both ext_proc modes: a configured rule splits `llama` between two served
models by weight, each request lands on a pod that serves the model it was rewritten to, the pod gets a body
naming that model (its content-length right), and the client reads its own model name back."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from picker_lab.supervisor import (
    Backends,
    Envoy,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_envoy,
    start_picker,
)
from tests.waiting import eventually_async

REWRITES = {"scheduling": {"models": {"rewrites": [
    {"name": "llama-canary", "matches": [{"model": {"value": "llama"}}],
     "targets": [{"modelRewrite": "llama-v1", "weight": 3}, {"modelRewrite": "llama-v2", "weight": 1}]},
    {"name": "everything-else", "targets": [{"modelRewrite": "llama-v1"}]},
]}}}


@dataclass
class Stack:
    pods: Backends
    envoys: dict[str, Envoy]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with process_scope("model-rewrite") as (logdir, started):
        pods = start_backends(3, logdir)
        started.append(pods.process)
        for address, model in zip(pods.addresses, ("llama-v1", "llama-v1", "llama-v2"), strict=True):
            set_echo_metrics(address, models=[model])
        picker = start_picker(logdir, endpoints=pods.addresses, extra=[
            "--config-text", json.dumps(REWRITES), "--metrics-fast-interval", "50ms",
            "--metrics-slow-interval", "100ms"])
        started.append(picker.process)
        envoys = {}
        for mode, response_body in (("buffered", "streamed"), ("full-duplex", "none")):
            envoys[mode] = start_envoy(logdir, picker, pods.addresses, mode=mode, name=f"envoy-{mode}",
                                       response_body=response_body)
            started.append(envoys[mode].process)
        yield Stack(pods, envoys)


async def ask(session: aiohttp.ClientSession, envoy: Envoy, model: str, text: str,
              stream: bool = False) -> dict[str, object]:
    body = {"model": model, "prompt": text, "stream": stream}
    async with session.post(envoy.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if not stream:
            return dict(await response.json())
        events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                  if line.startswith("data: {")]
        return dict(events[0])


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_a_weighted_rewrite_routes_to_the_target_and_the_client_keeps_its_name(stack: Stack,
                                                                                      mode: str) -> None:
    envoy = stack.envoys[mode]
    serves = dict(zip(stack.pods.addresses, ("llama-v1", "llama-v1", "llama-v2"), strict=True))
    async with aiohttp.ClientSession() as session:

        async def learned() -> bool:  # until the pods' models are scraped, any pod may be chosen
            replies = [await ask(session, envoy, "llama", f"warm {i}") for i in range(8)]
            return all(serves[str(r["served_by"])] == r["received_model"] for r in replies)
        await eventually_async(learned, "the pods' models scraped", within=10)
        replies = await asyncio.gather(*(ask(session, envoy, "llama", f"question {i} " * 20) for i in range(200)))
        other = await ask(session, envoy, "anything", "a catch-all rule")
        streamed = await ask(session, envoy, "llama", "streamed " * 30, stream=True)
    targets = Counter(str(r["received_model"]) for r in replies)
    for reply in replies:
        assert serves[str(reply["served_by"])] == reply["received_model"]  # on a pod serving its target
        assert reply["model"] == "llama"  # the client reads the model it asked for
    # 3:1 by weight: 150 expected of 200 for llama-v1 (sd ~6.1); 122..178 is over 4.5 sd either side (a false
    # failure about once in 150,000 runs; 3 sd failed once in CI), while an even split (100) stays far outside
    assert 122 <= targets["llama-v1"] <= 178 and targets["llama-v1"] + targets["llama-v2"] == 200
    assert other["received_model"] == "llama-v1" and other["model"] == "anything"
    assert serves[str(streamed["served_by"])] == streamed["received_model"]
    assert streamed["model"] == "llama"  # rewritten back in the streamed chunks too


async def test_the_header_wins_over_a_rule(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            stack.envoys["buffered"].url + "/v1/completions", json={"model": "llama", "prompt": "pinned " * 10},
            headers={"x-gateway-model-name-rewrite": "llama-v2"}) as response:
        reply = await response.json()
    assert reply["received_model"] == "llama-v2" and reply["served_by"] == stack.pods.addresses[2]
