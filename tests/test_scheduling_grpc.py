"""GIE's hermetic scheduling scenarios, driven over a real ext_proc gRPC stream (and through Envoy) against a running picker whose
pods (echo backends) report chosen vLLM metrics; plus prefix affinity and the endpoint lifecycle."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest

import picker.api  # noqa: F401
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker_lab.supervisor import (
    Backends,
    Envoy,
    Picker,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
)
from tests.test_extproc_grpc import body_msg, destination, exchange, headers_msg
from tests.waiting import eventually_async

CONFIG = """
refresh-metrics-interval: 50ms
unhealthy-after-failures: 2
admission:
  objectives: {batch: -1, interactive: 1}
  staleThreshold: 2s
"""
IDLE = {"waiting": 0, "running": 0, "kv": 0.0, "running_loras": [], "waiting_loras": [], "down": False}


@dataclass
class Scene:
    pods: Backends
    picker: Picker
    envoy: Envoy

    async def set(self, **per_pod: dict[str, Any]) -> None:
        """Set each pod's reported metrics (keys: pod index as 'p0', 'p1', ...) and wait until the picker saw them.

        "Saw" means: two scrapes of every pod that still answers ended after the change, so the second one was
        sent after it (a pod is never scraped twice at once) and every field the picker holds is the new one.
        """
        wanted = {a: {**IDLE, **per_pod.get(f"p{i}", {})} for i, a in enumerate(self.pods.addresses)}
        async with aiohttp.ClientSession() as session:
            for address, values in wanted.items():
                async with session.post(f"http://{address}/test/metrics", json=values) as response:
                    assert response.status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.picker.grpc_port}") as channel:
            stub = picker_pb2_grpc.PickerStub(channel)

            async def scraped_since(moment: float) -> bool:
                # Taken before the call: a metrics age below it means a scrape that ended after `moment` (the
                # picker and the test share the machine's monotonic clock).
                elapsed = time.monotonic() - moment
                listing = await stub.ListEndpoints(picker_pb2.ListEndpointsRequest())
                seen = {e.address: e for e in listing.endpoints}
                return all(seen[a].waiting == v["waiting"] and abs(seen[a].kv_cache_usage - v["kv"]) < 1e-9
                           and seen[a].metrics_age_seconds >= 0
                           and (v["down"] or seen[a].metrics_age_seconds < elapsed)  # a down pod's scrapes fail
                           for a, v in wanted.items())

            for _ in range(2):  # the first scrape that ends after the change may have been sent before it
                await eventually_async(functools.partial(scraped_since, time.monotonic()),
                                       "the picker saw the pods' new metrics")

    async def route(self, body: dict[str, Any], **headers: str) -> tuple[str, int]:
        """Destination (or "") and HTTP status of one request through a raw ext_proc stream."""
        extra = {k.replace("_", "-"): v for k, v in headers.items()}
        responses = await exchange(self.picker.grpc_port, [headers_msg(body.pop("_path", "/v1/completions"),
                                                                       extra=extra),
                                                           body_msg(json.dumps(body).encode())])
        last = responses[-1]
        if last.HasField("immediate_response"):
            return "", last.immediate_response.status.code
        return destination(last, "request_body"), 200


@contextlib.contextmanager
def running_scene(name: str, config: str) -> Iterator[Scene]:
    """Three echo pods, `picker serve --config-file` (YAML text `config`) and Envoy, stopped on exit."""
    with process_scope(name) as (logdir, started):
        pods = start_backends(3, logdir, name="pods")
        started.append(pods.process)
        path = logdir / "picker.yaml"
        path.write_text(config)
        picker = start_picker(logdir, endpoints=pods.addresses, extra=["--config-file", str(path)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pods.addresses)
        started.append(envoy.process)
        yield Scene(pods, picker, envoy)


@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    with running_scene("scheduling", CONFIG) as started:
        yield started


def prompt(tag: str, words: int = 40) -> dict[str, Any]:
    return {"model": "tiny", "prompt": " ".join(f"{tag}{i}" for i in range(words)), "max_tokens": 8}


async def test_picks_the_pod_with_lower_queue_and_kv(scene: Scene) -> None:
    await scene.set(p0={"waiting": 4, "kv": 0.7}, p1={"waiting": 0, "kv": 0.1}, p2={"waiting": 3, "kv": 0.5})
    for i in range(3):
        dest, status = await scene.route(prompt(f"load{i}x"))
        assert (dest, status) == (scene.pods.addresses[1], 200)
    # read from the page cut down to the series the picker reads, as vLLM answers `/metrics/?name[]=...`
    async with aiohttp.ClientSession() as session:
        for address in scene.pods.addresses:
            async with session.get(f"http://{address}/test/count") as response:
                count = await response.json()
            assert count["filtered_metrics_pages"] > 0 and count["metrics_pages"] == 0


async def test_picks_the_pod_with_the_lora_adapter_despite_higher_kv(scene: Scene) -> None:
    await scene.set(p0={"kv": 0.2, "max_lora": 1, "running_loras": ["other-lora"]},
                    p1={"kv": 0.6, "running_loras": ["sql-lora"]},
                    p2={"kv": 0.2, "max_lora": 1, "running_loras": ["other-lora"]})
    body = {**prompt("lora"), "model": "sql-lora"}
    dest, status = await scene.route(dict(body))
    assert (dest, status) == (scene.pods.addresses[1], 200)
    async with aiohttp.ClientSession() as session, session.post(scene.envoy.url + "/v1/completions",
                                                                json={**body, "prompt": "via envoy"}) as response:
        assert (await response.json())["served_by"] == scene.pods.addresses[1]


async def test_saturated_pool_sheds_only_sheddable_requests(scene: Scene) -> None:
    full = {"waiting": 20, "kv": 0.99}
    await scene.set(p0=full, p1=full, p2=full)
    _, status = await scene.route(prompt("std"))
    assert status == 200, "standard requests are not shed by default"
    _, status = await scene.route(prompt("crit"), x_gateway_inference_objective="interactive")
    assert status == 200
    responses = await exchange(scene.picker.grpc_port, [
        headers_msg("/v1/completions", extra={"x-gateway-inference-objective": "batch"}),
        body_msg(json.dumps(prompt("shed")).encode())])
    immediate = responses[-1].immediate_response
    assert immediate.status.code == 429
    assert json.loads(immediate.body)["error"]["code"] == "saturated"
    assert {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}["retry-after"] == b"1"
    # The same through Envoy: the client sees the 429, its JSON reason and Retry-After.
    async with aiohttp.ClientSession() as session, session.post(
            scene.envoy.url + "/v1/completions", json=prompt("shed-envoy"),
            headers={"x-gateway-inference-objective": "batch"}) as response:
        assert response.status == 429
        assert response.headers["retry-after"] == "1"
        assert (await response.json())["error"]["code"] == "saturated"
    await scene.set()
    _, status = await scene.route(prompt("shed-ok"), x_gateway_inference_objective="batch")
    assert status == 200, "sheddable traffic flows again once the pool has room"


async def explained(scene: Scene, body: dict[str, Any], **headers: str) -> list[Any]:
    """The unfiltered candidates of Explain's answer for one request (scores and details), routing nothing."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scene.picker.grpc_port}") as channel:
        answer = await picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
            path="/v1/completions", body=json.dumps(body).encode(), headers=headers))
    return [c for c in answer.candidates if not c.filtered_by]


async def explain(scene: Scene, body: dict[str, Any], **headers: str) -> dict[str, dict[str, float]]:
    """Each unfiltered candidate's scores (address -> scorer -> score) for one request, routing nothing."""
    return {c.address: dict(c.scores) for c in await explained(scene, body, **headers)}


async def test_the_deal_counts_the_cold_prefill_each_pod_was_handed(scene: Scene) -> None:
    """The cold-prompt deal remembers how many uncached prompt tokens it handed each pod lately (a pod still
    prefilling a long cold prompt is skipped when its turn comes): while both requests are in flight through Envoy,
    a long cold prompt weighs on its pod hundreds of times as much as a short one on another, and Explain shows it;
    once they have ended, nothing is counted."""
    await scene.set()

    def work(candidates: list[Any]) -> dict[str, float]:
        return {c.address: c.details["cold-prefix-spreader.work_tokens"] for c in candidates}

    async with held(scene, prompt("longcold", words=2000)) as long_pod, \
            held(scene, prompt("shortcold", words=4)) as short_pod:
        assert short_pod != long_pod
        dealt = work(await explained(scene, prompt("probe")))
        assert dealt[long_pod] > 100 * dealt[short_pod] > 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scene.picker.grpc_port}") as channel:
        stub = picker_pb2_grpc.PickerStub(channel)

        async def answered() -> bool:
            listing = await stub.ListEndpoints(picker_pb2.ListEndpointsRequest())
            return all(e.in_flight == 0 for e in listing.endpoints)

        await eventually_async(answered, "both requests ended")
    assert set(work(await explained(scene, prompt("probe"))).values()) == {0.0}


@contextlib.asynccontextmanager
async def held(scene: Scene, body: dict[str, Any]) -> AsyncIterator[str]:
    """One streamed request through Envoy, held in flight (its pod spaces its events far apart) until the block
    ends and the client goes away: the pod that serves it."""
    slow = {**body, "stream": True, "test_events": 2, "test_event_delay": 60.0}
    async with aiohttp.ClientSession() as session, session.post(scene.envoy.url + "/v1/completions",
                                                                json=slow) as response:
        first = await response.content.readline()  # b"data: {...}" with the pod's answer
        yield str(json.loads(first.removeprefix(b"data: "))["served_by"])


async def test_a_session_whose_pod_is_known_is_not_dealt_as_a_cold_prompt(scene: Scene) -> None:
    """A conversation's next turn that shares nothing cacheable with its last (a short question) is cold on every
    pod; the cold-prompt deal stands aside for it and session affinity keeps it on the session's pod, through
    Envoy too. A cold prompt without a session is dealt."""
    await scene.set()
    pod, _ = await scene.route(prompt("turnone"), x_session_id="conv-7")
    scores = await explain(scene, prompt("turntwo"), **{"x-session-id": "conv-7"})
    assert {a: s["cold-prefix-spreader"] for a, s in scores.items()} == dict.fromkeys(scores, 0.0)
    assert {a: s["session-affinity-scorer"] for a, s in scores.items()} == {a: float(a == pod) for a in scores}
    assert max(s["cold-prefix-spreader"] for s in (await explain(scene, prompt("nosession"))).values()) == 1.0
    async with aiohttp.ClientSession() as session, session.post(
            scene.envoy.url + "/v1/completions", json=prompt("turnthree"),
            headers={"x-session-id": "conv-7"}) as response:
        assert (await response.json())["served_by"] == pod


async def test_a_prompt_mostly_cold_everywhere_is_dealt_though_one_pod_holds_its_opening(scene: Scene) -> None:
    """A conversation's first turn: a system prompt one pod holds, then a long question no pod holds. Past its
    opening the prompt is cold wherever it goes, so the deal spreads it (docs/decisions.md), through Envoy
    too; a prompt the holder has most of is left to the prefix scorer."""
    await scene.set()
    system = " ".join(f"persona{i}" for i in range(40))
    async with aiohttp.ClientSession() as session:
        async with session.post(scene.envoy.url + "/v1/completions",
                                json={"model": "tiny", "prompt": system + " hello", "max_tokens": 8}) as response:
            holder = (await response.json())["served_by"]
        first_turn = {"model": "tiny", "prompt": system + " " + " ".join(f"story{i}" for i in range(500)),
                      "max_tokens": 8}
        deal = {a: s["cold-prefix-spreader"] for a, s in (await explain(scene, first_turn)).items()}
        assert deal[holder] < max(deal.values()) == 1.0
        async with session.post(scene.envoy.url + "/v1/completions", json=first_turn) as response:
            assert (await response.json())["served_by"] != holder
    next_turn = await explain(scene, {"model": "tiny", "prompt": system + " hello again"})
    assert {s["cold-prefix-spreader"] for s in next_turn.values()} == {0.0}


async def test_shared_prefix_sticks_and_cold_prefixes_spread(scene: Scene) -> None:
    await scene.set()
    shared = " ".join(f"system{i}" for i in range(400))
    first, _ = await scene.route({"model": "tiny", "prompt": shared + " question zero"})
    for i in range(6):
        dest, _ = await scene.route({"model": "tiny", "prompt": shared + f" question {i + 1}"})
        assert dest == first, "a long shared prefix should keep landing on the pod that holds it"

    async def idle_again() -> bool:
        # The shared prompts' recent prefill work decays (50 ms half-life) until every pod's in-flight load score
        # is level again; a cold prompt's explanation shows it without routing anything.
        scores = [s["in-flight-load-scorer"] for s in (await explain(scene, prompt("probe"))).values()]
        return len(scores) == 3 and min(scores) >= 0.999

    await eventually_async(idle_again, "the pods' recent prefill work decayed: idle pods again")
    cold = {(await scene.route(prompt(f"cold{i}q")))[0] for i in range(9)}
    assert len(cold) == 3, f"cold prefixes should spread over idle pods, got {cold}"


async def test_a_pod_whose_metrics_fail_is_degraded_and_keeps_its_traffic_and_prefixes(scene: Scene) -> None:
    """Its serving port still answers: it stays routable on the picker's own view (a pod that cannot be reached
    leaves the ready set: tests/test_degraded_envoy.py)."""
    await scene.set()
    shared = {"model": "tiny", "prompt": " ".join(f"lifecycle{i}" for i in range(400))}
    holder, _ = await scene.route(dict(shared))
    index = scene.pods.addresses.index(holder)
    await scene.set(**{f"p{index}": {"down": True}})  # its /metrics now fails
    async with grpc.aio.insecure_channel(f"127.0.0.1:{scene.picker.grpc_port}") as channel:
        stub = picker_pb2_grpc.PickerStub(channel)

        async def state() -> str:
            listing = await stub.ListEndpoints(picker_pb2.ListEndpointsRequest())
            return {e.address: e.state for e in listing.endpoints}[holder]

        async def degraded() -> bool:
            return await state() == "degraded"

        await eventually_async(degraded, "the pod marked degraded", within=2.0)
        for _ in range(3):
            dest, status = await scene.route(dict(shared))
            assert (dest, status) == (holder, 200)
        await scene.set()  # its metrics are readable again
        assert await state() == "ready"
        explained = await stub.Explain(picker_pb2.ExplainRequest(path="/v1/completions",
                                                                 body=json.dumps(shared).encode()))
        matched = {c.address: c.scores["prefix-cache-scorer"] for c in explained.candidates}
        assert matched[holder] > 0.5, "a degraded pod's prefixes are kept"


async def test_fallback_list_is_ranked_and_unique() -> None:
    with process_scope("fallbacks") as (logdir, started):
        pods = start_backends(3, logdir, name="pods")
        started.append(pods.process)
        picker = start_picker(logdir, endpoints=pods.addresses, extra=["--fallback-endpoints", "2"])
        started.append(picker.process)
        responses = await exchange(picker.grpc_port, [headers_msg("/v1/completions"),
                                                      body_msg(json.dumps(prompt("fb")).encode())])
    assert not responses[-1].HasField("immediate_response"), responses[-1]
    ranked = destination(responses[-1], "request_body").split(",")
    assert len(ranked) == 2 and len(set(ranked)) == 2 and set(ranked) <= set(pods.addresses)
