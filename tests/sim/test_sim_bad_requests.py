"""The simulator never hangs: wrong-typed bodies get vLLM's 400 fast, and a failure inside the engine fails
only the request it happened in (a 500), never the pod.

Regression for: `role: 5`, `stream: "yes"`, `tools: "x"`, content parts `[{"type": "text", "text": 5}, null,
3]`, `temperature: NaN` and a lone surrogate (`"\\ud800"` in content, model or cache_salt) were coerced or
passed on; a surrogate cache_salt on a prompt with a full KV block crashed the engine loop, after which the
pod still answered /health while every request to it hung.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from picker_lab.sim import engine as engine_module
from picker_lab.sim.engine import ERROR, Engine, SimRequest
from picker_lab.sim.fleet import SimFleet
from picker_lab.sim.kvcache import NONE_HASH, block_hashes, hash_block
from picker_lab.sim.openai_api import ApiError, ServedModel, parse_chat, parse_completion
from picker_lab.sim.profiles import TINY_CPU
from picker_lab.sim.server import SimPod
from picker_lab.sim.tokenizer import Tokenizer, is_utf8, render_chat
from tests.waiting import eventually_async

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG = "hello there " * 300  # several 128-token blocks: a cache salt gets hashed into block 0
SURROGATE = "\ud800"
USER = [{"role": "user", "content": "hi"}]
GOOD = {CHAT: {"messages": USER, "max_tokens": 2}, COMPLETIONS: {"prompt": "hi", "max_tokens": 2}}
BUDGET_S = 0.1  # the bound on answering a bad body

# (endpoint, body, text the error message must contain: the field it names)
BAD_BODIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat-role-5": (CHAT, {"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role: must be a string"),
    "chat-stream-yes": (CHAT, {"messages": USER, "stream": "yes"}, "stream: must be a boolean"),
    "chat-tools-x": (CHAT, {"messages": USER, "tools": "x"}, "tools: must be a list"),
    "chat-content-parts": (CHAT, {"messages": [{"role": "user",
                                                "content": [{"type": "text", "text": 5}, None, 3]}]},
                           "messages[0].content[0].text: must be a string"),  # fmt: skip
    "chat-null-part": (CHAT, {"messages": [{"role": "user", "content": ["ok", None]}]},
                       "messages[0].content[1]"),  # fmt: skip
    "chat-temperature-nan": (CHAT, {"messages": USER, "temperature": float("nan")},
                             "temperature must be a finite"),  # fmt: skip
    "chat-top-p-nan": (CHAT, {"messages": USER, "top_p": float("nan")}, "top_p must be in (0, 1]"),
    "chat-surrogate-content": (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]},
                               "messages[0].content: must be valid UTF-8"),  # fmt: skip
    "chat-surrogate-model": (CHAT, {"model": SURROGATE, "messages": USER}, "model: must be valid UTF-8"),
    "chat-surrogate-salt": (CHAT, {"messages": [{"role": "user", "content": LONG}], "cache_salt": SURROGATE},
                            "cache_salt: must be valid UTF-8"),  # fmt: skip
    "chat-max-tokens-0": (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens must be at least 1"),
    "chat-n-string": (CHAT, {"messages": USER, "n": "2"}, "`n` must be an integer"),
    "chat-stop-5": (CHAT, {"messages": USER, "stop": 5}, "stop: must be a string or a list of strings"),
    "chat-message-null": (CHAT, {"messages": [None]}, "messages[0]: must be an object"),
    "chat-stream-options": (CHAT, {"messages": USER, "stream": True, "stream_options": "x"},
                            "stream_options: must be an object"),  # fmt: skip
    "completion-stream-yes": (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream: must be a boolean"),
    "completion-temperature-nan": (COMPLETIONS, {"prompt": "hi", "temperature": float("nan")},
                                   "temperature must be a finite"),  # fmt: skip
    "completion-surrogate-prompt": (COMPLETIONS, {"prompt": ["ok", SURROGATE]},
                                    "prompt[1]: must be valid UTF-8"),  # fmt: skip
    "completion-surrogate-model": (COMPLETIONS, {"model": SURROGATE, "prompt": "hi"},
                                   "model: must be valid UTF-8"),  # fmt: skip
    "completion-surrogate-salt": (COMPLETIONS, {"prompt": LONG, "cache_salt": SURROGATE},
                                  "cache_salt: must be valid UTF-8"),  # fmt: skip
    "completion-bool-token": (COMPLETIONS, {"prompt": [True, 2]}, "prompt must be a string"),
    "completion-ignore-eos-yes": (COMPLETIONS, {"prompt": "hi", "ignore_eos": "yes"},
                                  "ignore_eos: must be a boolean"),  # fmt: skip
}


def raw(body: dict[str, Any]) -> bytes:
    """The body as a client would send it: NaN as the JSON extension `NaN`, a lone surrogate as `\\ud800`."""
    return json.dumps(body).encode()


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(1, profile="tiny-cpu", time_scale=20.0) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # every call is bounded: a regression must fail the test, not hang it
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def post_raw(http: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, Any, float]:
    """(status, JSON body, seconds until the whole answer was read)."""
    start = time.perf_counter()
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        text = await resp.text()
        elapsed = time.perf_counter() - start
        return resp.status, json.loads(text) if text else None, elapsed


def assert_bad_request(body: Any, expected: str) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert expected in error["message"], error["message"]


@pytest.mark.parametrize("case", list(BAD_BODIES))
async def test_bad_body_is_a_fast_400_and_the_pod_keeps_serving(
    case: str, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    path, body, expected = BAD_BODIES[case]
    url = fleet.urls[0] + path
    timings = []
    for _ in range(3):
        status, answer, elapsed = await post_raw(http, url, raw(body))
        assert status == 400, answer
        assert_bad_request(answer, expected)
        timings.append(elapsed)
        status, _, _ = await post_raw(http, url, raw(GOOD[path]))  # a normal request right after still works
        assert status == 200
    assert min(timings) < BUDGET_S, f"{case}: fastest of 3 took {min(timings) * 1000:.0f} ms"
    assert fleet.pods[0].engine.stats.finished.get(ERROR, 0) == 0


async def test_tokenize_and_render_refuse_the_same_bodies(
    fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    url = fleet.urls[0]
    status, body, _ = await post_raw(http, url + "/tokenize", raw({"prompt": SURROGATE}))
    assert status == 400 and "prompt: must be valid UTF-8" in body["error"]["message"]
    bad_role = raw({"messages": [{"role": 5, "content": "hi"}]})
    status, body, _ = await post_raw(http, url + "/v1/chat/completions/render", bad_role)
    assert status == 400 and "messages[0].role" in body["error"]["message"]
    status, _, _ = await post_raw(http, url + "/tokenize", raw({"messages": USER}))
    assert status == 200


def test_wrong_typed_fields_are_refused_by_the_parsers_and_good_ones_still_pass() -> None:
    served = ServedModel("tiny", "tiny", 4096, Tokenizer(4096))
    ok_chat = {"messages": [{"role": "system", "content": None}, {"role": "user", "content": [
        "plain", {"type": "text", "text": "part"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
        "tools": [], "stop": ["a", "b"], "temperature": 0, "top_p": 1.0, "max_tokens": None, "stream": False,
        "cache_salt": "sel-\u00e9\U0001f600"}  # fmt: skip
    assert parse_chat(ok_chat, served).prompts[0]
    assert parse_completion({"prompt": [[5, 6], "text"], "stop": "x", "temperature": 1.5}, served).prompts
    for body, message in [
        ({"messages": USER, "temperature": 3}, "temperature must be in [0, 2]"),
        ({"messages": USER, "top_p": 0}, "top_p must be in (0, 1]"),
        ({"messages": USER, "temperature": True}, "temperature: must be a number"),
        ({"messages": USER, "temperature": 10**400}, "temperature must be a finite number, got inf"),
        ({"messages": USER, "n": 10**9}, "n must be at most 16384"),
        ({"messages": USER, "model": 5}, "model: must be a string"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role: is required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be a string, a list"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0].type"),
        ({"messages": USER, "tools": ["x"]}, "tools[0]: must be an object"),
        ({"messages": USER, "stop": ["a", 5]}, "stop[1]: must be a string"),
        ({"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt: must be a boolean"),
        ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "include_usage: must"),
        ({"messages": USER, SURROGATE: 1}, "must be valid UTF-8"),  # a key counts too
    ]:
        with pytest.raises(ApiError) as info:
            parse_chat(body, served)
        assert info.value.status == 400 and message in info.value.message, (body, info.value.message)
        assert info.value.body()["error"]["type"] == "BadRequestError"
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": [[1, True]]}, served)
    assert info.value.status == 400


def test_render_chat_refuses_what_it_cannot_render_instead_of_coercing() -> None:
    with pytest.raises(ValueError):
        render_chat([{"role": 5, "content": "hi"}])
    with pytest.raises(ValueError):
        render_chat([{"role": "user", "content": [{"type": "text", "text": 5}]}])
    with pytest.raises(ValueError):
        render_chat([{"role": "user", "content": [None]}])
    assert is_utf8("plain") and is_utf8("\u00e9\U0001f600") and not is_utf8("a" + SURROGATE)


# --- the engine survives what slips past the edge -------------------------------------------------------
def small_engine() -> Engine:
    return Engine(TINY_CPU.with_overrides(block_size=16, num_gpu_blocks=65, max_model_len=1024))


def drain(engine: Engine, limit: int = 10_000) -> dict[str, str]:
    """Step until idle; {request id: finish reason}."""
    reasons: dict[str, str] = {}
    now = 0.0
    for _ in range(limit):
        t = engine.next_step_time()
        if t is None:
            return reasons
        result = engine.step(max(now, t))
        now = result.end
        reasons.update({f.request_id: f.finish_reason for f in result.finished})
    raise AssertionError("engine did not go idle")


def test_surrogate_cache_salt_hashes_and_is_refused_by_add_request() -> None:
    tokens = list(range(100, 164))
    # any str hashes (this raised UnicodeEncodeError inside engine.step); valid text hashes as before
    assert len(block_hashes(tokens, 16, cache_salt=SURROGATE)) == 4
    salt = "s\u00e9l"
    assert block_hashes(tokens, 16, cache_salt=salt)[0] == hash_block(NONE_HASH, tokens[:16], salt.encode())
    engine = small_engine()
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(SimRequest("bad", tokens, 4, cache_salt=SURROGATE), 0.0)
    engine.add_request(SimRequest("good", tokens, 4, cache_salt="fine"), 0.0)
    assert drain(engine) == {"good": "length"}


def test_a_request_failing_in_scheduling_fails_alone_and_the_engine_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = small_engine()
    engine.add_request(SimRequest("before", list(range(300, 340)), 3), 0.0)
    engine.add_request(SimRequest("broken", list(range(400, 440)), 3), 0.0)
    engine.add_request(SimRequest("after", list(range(500, 540)), 3), 0.0)
    # a bug past validation: hashing this salt raises inside the step
    engine.requests["broken"].req.cache_salt = 5  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="picker_lab.sim.engine"):
        reasons = drain(engine)
    assert reasons == {"broken": ERROR, "before": "length", "after": "length"}
    assert len([r for r in caplog.records if r.name == "picker_lab.sim.engine"]) == 1  # logged once
    assert engine.stats.finished[ERROR] == 1 and engine.kv_usage() == 0.0
    engine.add_request(SimRequest("later", list(range(300, 340)), 3), 0.0)
    assert drain(engine) == {"later": "length"}


def test_a_request_failing_in_its_update_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = small_engine()
    engine.add_request(SimRequest("ok", list(range(300, 340)), 5), 0.0)
    engine.add_request(SimRequest("boom", list(range(600, 640)), 5), 0.0)
    boom_key = engine.requests["boom"].stream_key
    real_token = engine.words.token

    def token(stream_key: int, position: int) -> int:
        if stream_key == boom_key and position == 2:
            raise RuntimeError("injected sampling failure")
        return real_token(stream_key, position)

    monkeypatch.setattr(engine.words, "token", token)
    assert drain(engine) == {"ok": "length", "boom": ERROR}
    assert engine.kv_usage() == 0.0 and not engine.requests


def test_a_failure_outside_any_request_fails_those_in_flight_not_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = small_engine()
    engine.add_request(SimRequest("a", list(range(300, 340)), 3), 0.0)
    real = engine_module.step_duration
    calls = {"n": 0}

    def flaky(*args: Any) -> float:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected cost-model bug")
        return real(*args)

    monkeypatch.setattr(engine_module, "step_duration", flaky)  # the cost model the engine steps with
    assert drain(engine) == {"a": ERROR}
    engine.add_request(SimRequest("b", list(range(300, 340)), 3), 0.0)
    assert drain(engine) == {"b": "length"}


# --- the HTTP layer turns engine failures into answers --------------------------------------------------
INTERNAL = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                      "code": 500}}  # fmt: skip


def fail_next_sample(pod: SimPod, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next token the pod's engine samples raise (once)."""
    real_token = pod.engine.words.token
    armed = {"on": True}

    def token(stream_key: int, position: int) -> int:
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("injected engine failure")
        return real_token(stream_key, position)

    monkeypatch.setattr(pod.engine.words, "token", token)


async def test_engine_failure_is_a_500_then_the_pod_serves_again(
    fleet: SimFleet, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = fleet.pods[0]
    fail_next_sample(pod, monkeypatch)
    status, body, _ = await post_raw(http, pod.url + CHAT, raw(GOOD[CHAT]))
    assert status == 500 and body == INTERNAL
    status, _, _ = await post_raw(http, pod.url + CHAT, raw(GOOD[CHAT]))
    assert status == 200
    # streaming: the 200 is already out, so the error comes as an event, then [DONE] (as vLLM streams it)
    fail_next_sample(pod, monkeypatch)
    async with http.post(pod.url + COMPLETIONS, json={**GOOD[COMPLETIONS], "stream": True}) as resp:
        assert resp.status == 200
        events = (await resp.read()).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: ")) == INTERNAL
    status, _, _ = await post_raw(http, pod.url + COMPLETIONS, raw(GOOD[COMPLETIONS]))
    assert status == 200
    assert pod.engine.stats.finished[ERROR] == 2


async def test_unexpected_handler_exception_is_a_json_500(
    fleet: SimFleet, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("injected tokenizer bug")

    monkeypatch.setattr(fleet.pods[0].served.tokenizer, "encode", broken)
    status, body, _ = await post_raw(http, fleet.urls[0] + COMPLETIONS, raw(GOOD[COMPLETIONS]))
    assert status == 500 and body == INTERNAL
    monkeypatch.undo()
    status, _, _ = await post_raw(http, fleet.urls[0] + COMPLETIONS, raw(GOOD[COMPLETIONS]))
    assert status == 200


async def test_a_dead_engine_loop_fails_requests_and_health_instead_of_hanging(
    fleet: SimFleet, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = fleet.pods[0]

    def dead(now: float) -> Any:
        raise RuntimeError("injected driver crash")

    async def health() -> int:
        async with http.get(pod.url + "/health") as resp:
            return resp.status

    assert await health() == 200
    monkeypatch.setattr(pod.engine, "step", dead)  # bypasses step()'s own guard: the driver task dies
    status, body, _ = await post_raw(http, pod.url + COMPLETIONS, raw(GOOD[COMPLETIONS]))
    assert status == 500 and body == INTERNAL

    async def unhealthy() -> bool:
        return await health() == 503

    await eventually_async(unhealthy, "a dead engine makes /health answer 503", within=5)
    status, body, _ = await post_raw(http, pod.url + CHAT, raw(GOOD[CHAT]))  # new requests fail fast too
    assert status == 500 and body == INTERNAL


# --- the real `picker sim` process ----------------------------------------------------------------------
@pytest.fixture
def sim_process() -> Iterator[str]:
    """`picker sim` with one pod on a free loopback port; yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "picker.cli", "sim", "--pods", "1", "--base-port", "0",
         "--profile", "tiny-cpu", "--time-scale", "20"],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().split()[1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def http_post(url: str, data: bytes) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_picker_sim_process_answers_every_bad_body_and_stays_healthy(sim_process: str) -> None:
    for case, (path, body, expected) in BAD_BODIES.items():
        status, answer = http_post(sim_process + path, raw(body))
        assert status == 400, (case, answer)
        assert_bad_request(answer, expected)
        status, _ = http_post(sim_process + path, raw(GOOD[path]))
        assert status == 200, case
    with urllib.request.urlopen(sim_process + "/health", timeout=10) as resp:
        assert resp.status == 200
