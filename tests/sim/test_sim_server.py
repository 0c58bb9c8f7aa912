"""HTTP surface of the simulated pods: vLLM's JSON/SSE shapes, errors, usage, info endpoints, fleet helpers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.endpoints.metrics import parse_vllm_metrics
from picker.endpoints.scraper import MetricsTarget
from picker.endpoints.state import Endpoint
from picker_lab.sim.fleet import SimFleet, SimFleetThread
from picker_lab.sim.info_routes import NAMED_SCRAPE_SHARE

LONG_TEXT = " ".join(f"word{i % 97} and more text {i}" for i in range(300))  # ~1.8k tokens


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(2, profile="tiny-cpu", time_scale=20.0, lora_modules={"tinylora": "/loras/tiny"}) as f:
        yield f


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        text = await resp.text()
        return resp.status, dict(resp.headers), json.loads(text) if text else None


async def sse_events(url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
        return resp.headers["Content-Type"], raw.split("\n\n")


async def test_completion_json_shape_usage_and_pod_tag(fleet: SimFleet) -> None:
    url = fleet.urls[1] + "/v1/completions"
    status, headers, body = await post(url, {"model": "tiny", "prompt": LONG_TEXT, "max_tokens": 5})
    assert status == 200
    assert headers["x-sim-pod"] == "sim-1"
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["system_fingerprint"] == "vllm-0.32.0-sim-1" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert list(choice)[:5] == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert list(usage) == ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                           "completion_tokens_details"]  # fmt: skip
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}
    # the same prompt again: whole 128-token blocks are cached, never the last prompt token
    _, _, again = await post(url, {"model": "tiny", "prompt": LONG_TEXT, "max_tokens": 5})
    prompt_tokens = usage["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 128 * 128
    assert again["choices"][0]["text"] == choice["text"]  # deterministic output
    # the other pod has a cold cache
    _, headers0, other = await post(fleet.urls[0] + "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 5})
    assert headers0["x-sim-pod"] == "sim-0" and other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_completion_stream_matches_vllm_sse(fleet: SimFleet) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    content_type, events = await sse_events(fleet.urls[0] + "/v1/completions", body)
    assert content_type.startswith("text/event-stream")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 4
    for c in token_chunks:
        assert list(c) == ["id", "object", "created", "model", "choices"]
        assert c["object"] == "text_completion" and c["choices"][0]["index"] == 0
        assert set(c["choices"][0]) >= {"text", "logprobs", "finish_reason", "stop_reason"}
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None, None, None, "length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 4
    assert "prompt_tokens_details" in usage_chunk["usage"]
    assert len({c["id"] for c in chunks}) == 1


async def test_continuous_usage_stats_on_every_chunk(fleet: SimFleet) -> None:
    body = {"prompt": "Hello there", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    _, events = await sse_events(fleet.urls[0] + "/v1/completions", body)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3]
    assert all(list(c["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"] for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and "prompt_tokens_details" in chunks[-1]["usage"]


async def test_chat_stream_role_chunk_content_and_no_usage_without_option(fleet: SimFleet) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    _, events = await sse_events(fleet.urls[0] + "/v1/chat/completions", body)
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
    assert len(contents) == 3 and all(t.startswith(" ") for t in contents)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)
    # the non-streaming answer carries the same text
    _, _, full = await post(fleet.urls[0] + "/v1/chat/completions", {**body, "stream": False})
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == "".join(contents)
    assert full["choices"][0]["message"]["role"] == "assistant"


async def test_chat_prompt_is_rendered_with_the_template_and_shared_system_prompt_hits(fleet: SimFleet) -> None:
    system = {"role": "system", "content": LONG_TEXT}
    url = fleet.urls[0] + "/v1/chat/completions"
    _, _, first = await post(url, {"messages": [system, {"role": "user", "content": "first question"}],
                                   "max_tokens": 2})  # fmt: skip
    _, _, second = await post(url, {"messages": [system, {"role": "user", "content": "another one"}],
                                    "max_tokens": 2})  # fmt: skip
    async with aiohttp.ClientSession() as http:
        body = {"messages": [system], "add_generation_prompt": False}
        async with http.post(fleet.urls[0] + "/tokenize", json=body) as resp:
            tok = await resp.json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 4096
    assert tok["tokens"][0] == 1  # the template starts with BOS
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the rendered system turn is a common prefix of both prompts: all its full blocks hit
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 128 == 0
    assert tok["count"] // 128 * 128 <= cached <= (second["usage"]["prompt_tokens"] - 1) // 128 * 128
    assert cached >= 1024


async def test_errors_look_like_vllm(fleet: SimFleet) -> None:
    url = fleet.urls[0]
    status, headers, body = await post(url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and headers["x-sim-pod"] == "sim-0"
    assert body == {"error": {"message": "The model `nope` does not exist. Valid aliases: tiny, tinylora.",
                              "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip
    status, _, body = await post(url + "/v1/completions", {"prompt": "word " * 5000, "max_tokens": 1})
    assert status == 400 and body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert "maximum context length is 4096" in body["error"]["message"]
    status, _, body = await post(url + "/v1/completions", {"prompt": "short", "max_tokens": 4095})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, _, body = await post(url + "/v1/chat/completions", {"messages": []})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = await post(url + "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})
    assert status == 400
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == 400
        async with http.get(url + "/nowhere") as resp:
            assert resp.status == 404 and resp.headers["x-sim-pod"] == "sim-0"


async def test_models_health_tokenize_render_and_router_probes(fleet: SimFleet) -> None:
    url = fleet.urls[0]
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with http.get(url + "/v1/models") as resp:
            models = await resp.json()
        assert [m["id"] for m in models["data"]] == ["tiny", "tinylora"]
        assert models["data"][1]["parent"] == "tiny" and models["data"][1]["root"] == "/loras/tiny"
        async with http.post(url + "/tokenize", json={"prompt": "Hello world"}) as resp:
            tok = await resp.json()
        assert tok["tokens"][0] == 1 and tok["count"] == len(tok["tokens"])
        async with http.post(url + "/v1/completions/render", json={"prompt": "Hello world"}) as resp:
            rendered = await resp.json()
        assert rendered == [{"token_ids": tok["tokens"]}]
        async with http.post(url + "/v1/chat/completions/render",
                             json={"messages": [{"role": "user", "content": "hi"}]}) as resp:  # fmt: skip
            chat = await resp.json()
        assert isinstance(chat, list) and chat[0]["token_ids"][0] == 1
        for path in ("/get_server_info", "/get_model_info"):
            async with http.get(url + path) as resp:
                assert resp.status == 200 and "model_path" in await resp.json()


async def test_lora_request_is_served_and_published_in_metrics(fleet: SimFleet) -> None:
    status, _, body = await post(fleet.urls[0] + "/v1/completions", {"model": "tinylora", "prompt": LONG_TEXT,
                                                                      "max_tokens": 2})  # fmt: skip
    assert status == 200 and body["model"] == "tinylora"
    # the adapter changes the block hashes: the base model does not hit the adapter's blocks
    _, _, base = await post(fleet.urls[0] + "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 2})
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with aiohttp.ClientSession() as http, http.get(fleet.urls[0] + "/metrics") as resp:
        text = await resp.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    info = fams["vllm:lora_requests_info"].samples
    assert any(s.labels["running_lora_adapters"] == "tinylora" for s in info)
    assert fams["vllm:prefix_cache_queries"].samples[0].value > 0


async def test_queue_shows_in_metrics_while_requests_wait() -> None:
    fleet = SimFleet(1, profile="tiny-cpu", time_scale=1.0, profile_overrides={"max_num_seqs": 2})
    async with fleet as f, aiohttp.ClientSession() as http:
        body = {"prompt": "some prompt", "max_tokens": 200}
        tasks = [asyncio.create_task(http.post(f.urls[0] + "/v1/completions", json=body)) for _ in range(5)]
        await asyncio.sleep(0.3)
        engine = f.pods[0].engine
        assert engine.num_running == 2 and engine.num_waiting == 3
        async with http.get(f.urls[0] + "/metrics") as resp:
            text = await resp.text()
        assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0' in text
        assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0' in text
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_client_disconnect_aborts_the_request() -> None:
    async with SimFleet(1, profile="tiny-cpu", time_scale=1.0) as f:
        engine = f.pods[0].engine
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "abc", "max_tokens": 3000, "stream": True}
            async with http.post(f.urls[0] + "/v1/completions", json=body) as resp:
                await resp.content.readline()
                assert engine.num_running == 1
        for _ in range(100):
            if not engine.has_work():
                break
            await asyncio.sleep(0.02)
        assert not engine.has_work() and engine.kv_usage() == 0.0
        assert engine.stats.finished["abort"] == 1


async def test_non_streaming_client_timeout_aborts_the_request() -> None:
    async with SimFleet(1, profile="tiny-cpu", time_scale=1.0) as f, aiohttp.ClientSession() as http:
        engine = f.pods[0].engine
        body = {"prompt": "abc", "max_tokens": 3000}
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(f.urls[0] + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        for _ in range(100):
            if not engine.has_work():
                break
            await asyncio.sleep(0.02)
        assert not engine.has_work() and engine.stats.finished["abort"] == 1


def test_sync_fleet_thread_serves_and_stops() -> None:
    import urllib.request

    with SimFleetThread(2, profile="tiny-cpu", time_scale=50.0) as fleet:
        urls = fleet.urls
        assert len(set(urls)) == 2
        req = urllib.request.Request(
            urls[1] + "/v1/completions",
            data=json.dumps({"prompt": "hello", "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["x-sim-pod"] == "sim-1"
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
        assert fleet.call(lambda: fleet.pods[1].engine.stats.generation_tokens) == 3
    with pytest.raises(OSError):
        urllib.request.urlopen(urls[0] + "/health", timeout=2)


async def test_a_scrape_cost_holds_the_pods_api_server() -> None:
    """With profile.scrape_cost_s, each GET /metrics holds that pod's API server: scrapes queue behind each other and
    a request that arrives meanwhile waits; the other pod is not held."""
    async with SimFleet(2, profile="tiny-cpu", time_scale=1.0,
                        profile_overrides={"scrape_cost_s": 0.05}) as f, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()

        async def scrape(url: str) -> None:
            async with http.get(url + "/metrics") as resp:
                assert resp.status == 200
                await resp.read()

        async def completion(url: str) -> float:
            start = loop.time()
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 1}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            return loop.time() - start

        start = loop.time()
        storm = [asyncio.create_task(scrape(f.urls[0])) for _ in range(6)]
        await asyncio.wait(storm, return_when=asyncio.FIRST_COMPLETED)  # the other five are queued by now
        held, free = await asyncio.gather(completion(f.urls[0]), completion(f.urls[1]))
        await asyncio.gather(*storm)
        assert loop.time() - start >= 6 * 0.05 * 0.9  # six scrapes one after the other
        assert held >= 0.15 and free < held  # the request waited for the scrapes ahead of it


async def test_a_pod_asked_for_the_series_read_answers_them_alone_at_a_third_of_the_cost() -> None:
    """As vLLM 0.32's exporter, a simulated pod answers `/metrics/?name[]=...` with only the samples named, and such
    a scrape holds its API server for NAMED_SCRAPE_SHARE of a whole page's cost (measured on real vLLM)."""
    async with SimFleet(1, profile="tiny-cpu", time_scale=1.0,
                        profile_overrides={"scrape_cost_s": 0.1}) as f, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        url = MetricsTarget().filtered_url(Endpoint.from_address(f.urls[0].removeprefix("http://")))
        assert url is not None
        timings = []
        for path in (url, f.urls[0] + "/metrics"):
            start = loop.time()
            async with http.get(path) as resp:
                assert resp.status == 200
                page = await resp.text()
            timings.append((loop.time() - start, len(page), parse_vllm_metrics(page)))
        (named_s, named_bytes, named), (whole_s, whole_bytes, whole) = timings
        assert named_bytes < whole_bytes / 10 and named == whole
        assert 0.1 * NAMED_SCRAPE_SHARE * 0.9 <= named_s < 0.1 * 0.9 <= whole_s
