"""The error contract through a real Envoy: every refusal is a status plus a JSON reason, the picker stays up."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from picker_lab.supervisor import Envoy
from tests.conftest import Stack

CHAT = "/v1/chat/completions"


async def send(envoy: Envoy, path: str, data: bytes, method: str = "POST") -> tuple[int, dict[str, object], str]:
    async with aiohttp.ClientSession() as session, session.request(method, envoy.url + path, data=data) as response:
        text = await response.text()
        assert response.headers.get("content-type", "").startswith("application/json"), text
        return response.status, json.loads(text), response.headers.get("retry-after", "")


@pytest.mark.parametrize("path,data,status,code", [
    (CHAT, b"{not json", 400, "invalid_json"),
    (CHAT, b"[1, 2]", 400, "invalid_json"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "missing_model"),
    (CHAT, json.dumps({"model": "tiny"}).encode(), 400, "missing_messages"),
    ("/v1/completions", json.dumps({"model": "tiny"}).encode(), 400, "missing_prompt"),
    (CHAT, b'{"model": "tiny", "messages": "\xff\xfe"}', 400, "invalid_utf8"),
    (CHAT, b"", 400, "empty_body"),
    ("/v1/unknown/thing", b'{"model": "tiny"}', 404, "unknown_path"),
])
async def test_bad_requests_get_json_errors(envoy: Envoy, stack: Stack, path: str, data: bytes, status: int,
                                            code: str) -> None:
    got, body, _ = await send(envoy, path, data)
    assert got == status, body
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == code and error["message"]
    stack.check_alive()


async def pod_requests(stack: Stack) -> int:
    """How many requests the echo pods have served so far (their /test/count)."""
    total = 0
    async with aiohttp.ClientSession() as session:
        for address in stack.backends.addresses:
            async with session.get(f"http://{address}/test/count") as response:
                total += int((await response.json())["requests"])
    return total


@pytest.mark.parametrize("data", [
    b"[" * 100_000,
    b'{"model": "tiny", "messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"}]}",
])
async def test_deeply_nested_json_is_400_and_reaches_no_pod(envoy: Envoy, stack: Stack, data: bytes) -> None:
    # A RecursionError in the picker used to end the ext_proc stream, and Envoy failed open to a pod.
    before = await pod_requests(stack)
    got, body, _ = await send(envoy, CHAT, data)
    assert got == 400, body
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "invalid_json", body
    assert await pod_requests(stack) == before
    stack.check_alive()


@pytest.mark.parametrize("data,code", [
    (b'{"model": "tiny", "max_tokens": ' + b"7" * 5000 + b', "prompt": "hi"}', "invalid_json"),
    (b'{"model": "\\ud800", "prompt": "hi"}', "invalid_text"),
    (b'{"model": "tiny", "prompt": "hi", "cache_salt": "\\udfff"}', "invalid_text"),
    (b'{"model": "tiny", "prompt": ["a", "b\\ud800c"]}', "invalid_text"),
    (b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}', "invalid_text"),
], ids=["huge-int", "surrogate-model", "surrogate-salt", "surrogate-prompt", "surrogate-key"])
async def test_unencodable_json_is_400_and_metrics_keep_answering(envoy: Envoy, stack: Stack, data: bytes,
                                                                  code: str) -> None:
    # Each used to end the stream with an exception (Envoy failed open to a pod) or, as a metric label, to make
    # every later /metrics scrape fail with 500.
    before = await pod_requests(stack)
    got, body, _ = await send(envoy, "/v1/completions", data)
    assert got == 400, body
    assert body["error"]["code"] == code, body  # type: ignore[index]
    assert await pod_requests(stack) == before
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
        assert response.status == 200
    good = json.dumps({"model": "tiny", "prompt": "\U0001F600 escaped pairs are fine"}).encode()  # \ud83d\ude00
    assert (await send_raw(envoy, "/v1/completions", good)) == 200


async def send_raw(envoy: Envoy, path: str, data: bytes, method: str = "POST") -> int:
    async with aiohttp.ClientSession() as session, session.request(method, envoy.url + path, data=data) as response:
        await response.read()
        return response.status


@pytest.mark.parametrize("method,path", [("DELETE", "/v1/completions"), ("GET", CHAT), ("PUT", "/v1/embeddings"),
                                         ("GET", "/v1/completions?x=1")])
async def test_wrong_method_on_an_inference_api_is_405_from_the_picker(envoy: Envoy, stack: Stack, method: str,
                                                                       path: str) -> None:
    before = await pod_requests(stack)
    async with aiohttp.ClientSession() as session, session.request(method, envoy.url + path) as response:
        body = await response.json()
        assert response.status == 405, body
        assert response.headers["allow"] == "POST"
        assert "x-picker-fail-open" not in response.headers  # the picker answered: nothing failed open
    assert body["error"]["code"] == "method_not_allowed"
    assert await pod_requests(stack) == before
    assert await send_raw(envoy, "/v1/models", b"", method="GET") == 200  # a GET elsewhere still reaches a pod


async def test_body_over_the_limit_is_413(envoy: Envoy, stack: Stack) -> None:
    # The stack's picker runs with --max-body-bytes 10Mi (Envoy buffers up to 16 MiB).
    raw = json.dumps({"model": "tiny", "prompt": "y" * (11 * 2**20)}).encode()
    got, body, _ = await send(envoy, "/v1/completions", raw)
    assert got == 413
    assert body["error"]["code"] == "body_too_large"  # type: ignore[index]
    stack.check_alive()


async def test_no_endpoints_is_503_and_pool_file_reloads(envoy: Envoy, stack: Stack) -> None:
    path = stack.picker.endpoints_file
    assert path is not None
    original = path.read_text()
    try:
        path.write_text("[]\n")
        for _ in range(60):
            got, body, _ = await send(envoy, CHAT, json.dumps({"model": "tiny", "messages": [
                {"role": "user", "content": "hi"}]}).encode())
            if got == 503:
                break
            await asyncio.sleep(0.1)
        assert got == 503 and body["error"]["code"] == "no_endpoints"  # type: ignore[index]
        async with aiohttp.ClientSession() as session, session.get(envoy.url + "/v1/models") as response:
            assert response.status == 503
    finally:
        path.write_text(original + "# restored\n")
    for _ in range(60):
        async with aiohttp.ClientSession() as session, session.get(envoy.url + "/v1/models") as response:
            if response.status == 200:
                break
        await asyncio.sleep(0.1)
    assert response.status == 200
    stack.check_alive()
