"""Images in prompts through real Envoy: requests that share an image (the same data URL, the same bytes encoded
otherwise, or the same remote URL) and the text before it land on the pod that served the first; Explain lists
the prompt's media with their token estimates."""

from __future__ import annotations

import base64
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker_lab.media_files import png
from picker_lab.supervisor import Envoy
from tests.conftest import Stack
from tests.test_envoy_routing import post

SYSTEM = "You describe pictures for a museum catalogue."  # short: the image is what the prompts share


def asking(image_url: str, question: str, system: str = SYSTEM, model: str = "tiny") -> dict[str, object]:
    return {"model": model, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                     {"type": "text", "text": question}]}]}


async def test_requests_sharing_an_image_land_where_the_first_was_served(envoy: Envoy, stack: Stack) -> None:
    raw = png(1280, 960, shade=envoy.port % 251) + bytes(100_000)  # a ~100 KB image, its own per Envoy
    same_bytes = {"plain": "data:image/png;base64," + base64.b64encode(raw).decode(),
                  "wrapped": "data:image/png;base64," + base64.encodebytes(raw).decode(),
                  "remote": f"https://images.example/{envoy.port}/vase.png"}
    system = f"{SYSTEM} Catalogue {envoy.port}."
    first_status, first = await post(envoy, "/v1/chat/completions", asking(same_bytes["plain"], "Who made it?",
                                                                           system))
    assert first_status == 200, first
    for name, url in same_bytes.items():
        if name == "remote":
            status, remote_first = await post(envoy, "/v1/chat/completions", asking(url, "Who made it?", system))
            assert status == 200
            home = remote_first["served_by"]
        else:
            home = first["served_by"]
        for i in range(3):
            status, body = await post(envoy, "/v1/chat/completions", asking(url, f"question {i} about it", system))
            assert status == 200, body
            assert body["served_by"] == home, (name, i)


@pytest.mark.parametrize(("model", "expected"), [("tiny", 391), ("tiles-model", 2227)])
async def test_routed_media_are_counted_with_their_tokens(envoy: Envoy, stack: Stack, model: str,
                                                          expected: int) -> None:
    """A 640 x 480 image counts as its model's processor family counts it: Qwen2-VL's patches by default, 391
    tokens; Idefics3's tiles for a model configured so, 2,227 (a real vLLM counted 2,228, `make media-real`)."""
    async def counted() -> tuple[float, float]:
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
            text = await response.text()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.labels.get("kind") == "image" and s.labels.get("model_name") == model}
        return values.get("picker_request_media_items_total", 0.0), values.get("picker_request_media_tokens_total", 0.0)

    items, tokens = await counted()
    raw = png(640, 480, shade=envoy.port % 199)
    status, _ = await post(envoy, "/v1/chat/completions",
                           asking("data:image/png;base64," + base64.b64encode(raw).decode(), "Count me.", model=model))
    assert status == 200
    assert await counted() == (items + 1, tokens + expected)


async def test_explain_lists_the_media_and_their_tokens(stack: Stack) -> None:
    raw = png(640, 480)
    body = asking("data:image/png;base64," + base64.b64encode(raw).decode(), "What is it?")
    async with stack.picker.aio_channel() as channel:
        answer = await picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
            path="/v1/chat/completions", body=json.dumps(body).encode()))
    assert [(m.kind, m.tokens, len(m.digest), m.source) for m in answer.media] == [("image", 391, 16, "data")]


async def test_an_unreadable_data_url_is_a_400_with_its_reason(envoy: Envoy) -> None:
    status, body = await post(envoy, "/v1/chat/completions", asking("data:image/png;base64,@@@", "What?"))
    assert status == 400
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "invalid_media" and "base64" in error["message"]
