"""Token usage metrics through real Envoy: the picker counts the usage a model server reports only where Envoy
shows it the response body (the full-duplex template, or the buffered one rendered with `--response-body
streamed`); the buffered default passes bodies straight by and records none."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.supervisor import Envoy, Picker, process_scope, start_backends, start_envoy, start_picker

TOKEN_FAMILIES = ("inference_objective_input_tokens", "inference_objective_output_tokens")


@dataclass
class TokenStack:
    pickers: dict[str, Picker]
    envoys: dict[str, Envoy]


@pytest.fixture(scope="module")
def token_stack() -> Iterator[TokenStack]:
    with process_scope("tokens") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        envoys: dict[str, Envoy] = {}
        pickers: dict[str, Picker] = {}
        for name, mode, response_body in (("buffered", "buffered", "none"),
                                          ("buffered-streamed", "buffered", "streamed"),
                                          ("full-duplex", "full-duplex", "none")):
            picker = start_picker(logdir, endpoints=backends.addresses, name=f"picker-{name}")
            started.append(picker.process)
            envoys[name] = start_envoy(logdir, picker, backends.addresses, mode=mode, name=f"envoy-{name}",
                                       response_body=response_body)
            started.append(envoys[name].process)
            pickers[name] = picker
        yield TokenStack(pickers, envoys)


def token_counts(picker: Picker) -> dict[str, tuple[float, float]]:
    """family -> (observations, sum)."""
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    out = {}
    for name in TOKEN_FAMILIES:
        samples = families[name].samples if name in families else []
        out[name] = (sum(s.value for s in samples if s.name.endswith("_count")),
                     sum(s.value for s in samples if s.name.endswith("_sum")))
    return out


async def send_both(envoy: Envoy) -> None:
    """One JSON completion and one SSE chat stream, each reporting usage (3 completion tokens)."""
    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny", "prompt": "count my tokens " * 10}
        async with session.post(envoy.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            await response.read()
        chat = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "stream my tokens"}]}
        async with session.post(envoy.url + "/v1/chat/completions", json=chat) as response:
            assert response.status == 200
            events = (await response.read()).decode()
            assert events.rstrip().endswith("data: [DONE]")  # the stream reached the client whole
            assert json.loads(events.split("data: ")[-2])["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("name", ["buffered-streamed", "full-duplex"])
async def test_usage_is_counted_where_envoy_streams_response_bodies(token_stack: TokenStack, name: str) -> None:
    picker = token_stack.pickers[name]
    await send_both(token_stack.envoys[name])
    counts = token_counts(picker)
    assert counts["inference_objective_output_tokens"] == (2.0, 6.0)
    observed, prompt_tokens = counts["inference_objective_input_tokens"]
    assert observed == 2.0 and prompt_tokens > 0


async def test_anthropic_usage_is_counted_with_its_cached_tokens(token_stack: TokenStack) -> None:
    """/v1/messages replies count `input_tokens` without the cached ones: the prompt is their sum, and a stream's
    `message_delta` carries only the output count (its input comes from `message_start`)."""
    picker, envoy = token_stack.pickers["full-duplex"], token_stack.envoys["full-duplex"]
    before = token_counts(picker)
    body = {"model": "tiny", "max_tokens": 8, "system": "be brief " * 20,
            "messages": [{"role": "user", "content": "count my Anthropic tokens"}]}
    # the echo pod reports len(body) // 4 prompt tokens (Anthropic: input_tokens without the cached eighths)
    expected = sum(len(json.dumps({**body, "stream": stream}).encode()) // 4 for stream in (False, True))
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            async with session.post(envoy.url + "/v1/messages", json={**body, "stream": stream}) as response:
                assert response.status == 200
                await response.read()
    after = token_counts(picker)
    prompts = after["inference_objective_input_tokens"][1] - before["inference_objective_input_tokens"][1]
    outputs = after["inference_objective_output_tokens"][1] - before["inference_objective_output_tokens"][1]
    assert outputs == 6.0
    assert prompts == expected


async def test_the_buffered_default_passes_bodies_by_and_counts_no_tokens(token_stack: TokenStack) -> None:
    picker = token_stack.pickers["buffered"]
    await send_both(token_stack.envoys["buffered"])
    assert token_counts(picker) == {name: (0.0, 0.0) for name in TOKEN_FAMILIES}
