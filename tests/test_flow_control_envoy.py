"""Flow control through real Envoy, on a pod whose metrics say it is full: sheddable requests are refused at once,
standard and critical ones wait (no answer, no pod reached) and are served when the pod shows room, a request
that outwaits the queue TTL gets 503 with the reference's reason header, and nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker_lab.supervisor import (
    Backends,
    Envoy,
    Picker,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_picker_fleet,
)
from tests.waiting import eventually_async

CONFIG = ("admission:\n  flowControl: {enabled: true, queueTtl: 1500ms}\n"
          "  objectives: [{name: batch, priority: -1}, {name: interactive, priority: 5}]\n")


@dataclass
class FlowStack:
    backends: Backends
    picker: Picker
    envoy: Envoy


@contextlib.contextmanager
def flow_stack(name: str, config: str) -> Iterator[FlowStack]:
    """An echo pod, a picker with `config` and its Envoy, stopped at the end."""
    with process_scope(name) as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, flags=["--config-text", config])
        started.extend(fleet.processes)
        yield FlowStack(backends, fleet.pickers[0], fleet.envoy)


@pytest.fixture(scope="module")
def flow() -> Iterator[FlowStack]:
    with flow_stack("flow-control", CONFIG) as stack:
        yield stack


def set_pod(stack: FlowStack, **state: object) -> None:
    set_echo_metrics(stack.backends.addresses[0], **state)


async def series(stack: FlowStack) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['outcome']}}}" if "outcome" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


async def charged_tokens(stack: FlowStack) -> dict[str, float]:
    """picker_flow_control_tokens_charged_total by fairness id."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as response:
        text = await response.text()
    return {s.labels["fairness_id"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "picker_flow_control_tokens_charged_total"}


async def post(session: aiohttp.ClientSession, stack: FlowStack, objective: str | None,
               prompt: str) -> tuple[int, dict[str, str], float]:
    headers = {"x-gateway-inference-objective": objective} if objective else {}
    began = time.monotonic()
    async with session.post(stack.envoy.url + "/v1/completions", json={"model": "tiny", "prompt": prompt},
                            headers=headers) as response:
        await response.read()
        return response.status, {k.lower(): v for k, v in response.headers.items()}, time.monotonic() - began


async def saturate(stack: FlowStack, waiting: int) -> None:
    """Set the pod's queue and wait until the picker has scraped it: two scrapes after the change (the first may
    have begun before it), and the pool gauge (refreshed every second) showing it."""
    scrapes = (await series(stack)).get("picker_model_server_scrapes_total", 0)
    set_pod(stack, waiting=waiting)

    async def seen() -> bool:
        now = await series(stack)
        return (now.get("picker_model_server_scrapes_total", 0) >= scrapes + 2
                and now.get("llm_d_epp_average_queue_size", -1) == waiting)
    await eventually_async(seen, "the picker scraped the pod's queue", within=10)


async def test_sheddable_gets_429_at_once_and_a_ttl_expiry_gets_503_with_the_reason(flow: FlowStack) -> None:
    await saturate(flow, 20)
    try:
        async with aiohttp.ClientSession() as session:
            shed = [await post(session, flow, "batch", f"batch {i}") for i in range(20)]
            assert {s for s, _, _ in shed} == {429}
            assert {(h["x-llm-d-request-dropped-reason"], h["retry-after"]) for _, h, _ in shed} == \
                {("rejected-saturated", "1")}
            took = sorted(t for _, _, t in shed)
            assert took[-1] < 0.05 * 4 and took[len(took) // 2] < 0.05, took  # p50 < 50 ms (p100 on a busy box)
            status, headers, waited = await post(session, flow, None, "waits out its TTL")
            assert status == 503 and headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
            assert headers["retry-after"] == "1" and 1.4 < waited < 4.0, waited  # the 1.5 s TTL, before Envoy's 5 s
    finally:
        await saturate(flow, 0)


async def test_queued_requests_are_served_when_the_pod_shows_room(flow: FlowStack) -> None:
    await saturate(flow, 20)
    before = await series(flow)
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(post(session, flow, objective, f"queued {i}"))
                 for i, objective in enumerate(["interactive", None, None, "interactive", None])]

        async def queued() -> bool:
            return (await series(flow)).get("llm_d_epp_flow_control_queue_size", 0) == 5
        await eventually_async(queued, "all five queued", within=5)
        assert not any(t.done() for t in tasks)  # nothing answered, nothing reached the pod while it is full
        set_pod(flow, waiting=0)
        results = await asyncio.gather(*tasks)
    assert [s for s, _, _ in results] == [200] * 5
    after = await series(flow)
    dispatched = "llm_d_epp_flow_control_requests_total{Dispatched}"
    assert after[dispatched] - before.get(dispatched, 0) == 5
    assert after.get("llm_d_epp_flow_control_queue_size", 0) == 0


async def test_waiters_go_by_priority_then_by_turns_between_tenants(flow: FlowStack) -> None:
    """Queued on a full pod: 20 standard requests of tenant-a, then 4 of tenant-b, then 3 critical ones. Once the
    pod shows room, the critical ones are served first, then the tenants take turns: tenant-b's four come among
    the first eight standard ones (first come first served would put them last), and nothing outwaits the TTL."""
    await saturate(flow, 20)
    order: list[str] = []

    async def send(session: aiohttp.ClientSession, label: str, headers: dict[str, str]) -> int:
        async with session.post(flow.envoy.url + "/v1/completions", json={"model": "tiny", "prompt": label},
                                headers=headers) as response:
            await response.read()
            order.append(label)
            return response.status

    async with aiohttp.ClientSession() as session:
        tasks = []
        for tenant, count in (("tenant-a", 20), ("tenant-b", 4)):
            for i in range(count):
                tasks.append(asyncio.create_task(send(session, f"{tenant} {i}",
                                                      {"x-llm-d-inference-fairness-id": tenant})))
            size = len(tasks)

            async def queued(size: int = size) -> bool:  # in this order: tenant-a's first
                return (await series(flow)).get("llm_d_epp_flow_control_queue_size", 0) == size
            await eventually_async(queued, f"{size} queued", within=5)
        for i in range(3):
            tasks.append(asyncio.create_task(send(session, f"critical {i}",
                                                  {"x-gateway-inference-objective": "interactive"})))

        async def all_queued() -> bool:
            return (await series(flow)).get("llm_d_epp_flow_control_queue_size", 0) == 27
        await eventually_async(all_queued, "27 queued", within=5)
        set_pod(flow, waiting=0)
        statuses = await asyncio.gather(*tasks)
    assert statuses == [200] * 27  # served, none past the 1.5 s TTL
    # a wave of dispatches may finish in any order: the first three answers are the critical ones, give or take
    # the wave they went in (the pool lets about five through before its level is full again)
    assert sum(label.startswith("critical") for label in order[:5]) == 3, order
    standard = [label for label in order if not label.startswith("critical")]
    assert sum(label.startswith("tenant-b") for label in standard[:10]) == 4, order


async def test_a_tenant_past_its_token_budget_gets_429_and_another_tenant_does_not() -> None:
    config = "admission:\n  flowControl: {enabled: true, tokensPerMinutePerFlow: 300}\n"
    with flow_stack("token-budget", config) as stack:
        envoy = stack.envoy
        async with aiohttp.ClientSession() as session:

            async def send(tenant: str) -> tuple[int, dict[str, str]]:
                body = {"model": "tiny", "prompt": "x" * 400}  # ~100 tokens (characters / 4)
                async with session.post(envoy.url + "/v1/completions", json=body,
                                        headers={"x-llm-d-inference-fairness-id": tenant}) as response:
                    await response.read()
                    return response.status, {k.lower(): v for k, v in response.headers.items()}
            statuses = [await send("tenant-a") for _ in range(4)]
            other = await send("tenant-b")
    assert [s for s, _ in statuses[:2]] == [200, 200] and statuses[-1][0] == 429
    assert statuses[-1][1]["x-llm-d-request-dropped-reason"] == "rejected-token-budget"
    assert int(statuses[-1][1]["retry-after"]) >= 1 and other[0] == 200


async def test_running_slots_held_back_let_a_critical_request_past_waiting_standard_ones() -> None:
    """`criticalSlotShare`: the pod runs 2 at most and 1 now; its last slot is held for critical requests, so a
    standard request waits (in the picker, not the pod) while a critical one goes at once."""
    config = ("admission:\n  flowControl: {enabled: true, criticalSlotShare: 0.5, maxRunningPerPod: 2}\n"
              "  objectives: [{name: interactive, priority: 5}]\n")
    with flow_stack("slots", config) as stack:
        set_pod(stack, running=1)

        async def busy() -> bool:
            return (await series(stack)).get("llm_d_epp_average_running_requests", -1) == 1
        await eventually_async(busy, "the picker scraped the pod's running request", within=10)
        async with aiohttp.ClientSession() as session:
            standard = asyncio.create_task(post(session, stack, None, "standard"))

            async def queued() -> bool:
                return (await series(stack)).get("llm_d_epp_flow_control_queue_size", 0) == 1
            await eventually_async(queued, "the standard request queued", within=5)
            status, _, _ = await post(session, stack, "interactive", "critical")
            assert status == 200 and not standard.done()
            set_pod(stack, running=0)  # the running request ended: a slot above the held one is free
            assert (await standard)[0] == 200


async def test_by_tokens_a_light_tenant_goes_before_a_heavy_one_that_queued_first() -> None:
    """`fairness: tokens`: queued on a full pod, 8 requests of a tenant sending ~1,000-token prompts, then 8 of one
    sending ~10-token prompts. Once the pod shows room, the light tenant's all come among the first answers: each
    heavy request charged its tenant a hundred light ones' tokens (by turns they would alternate)."""
    config = "admission:\n  flowControl: {enabled: true, queueTtl: 3s, fairness: tokens}\n"
    with flow_stack("token-fairness", config) as stack:
        await saturate(stack, 20)
        order: list[str] = []

        async def send(session: aiohttp.ClientSession, tenant: str, i: int, prompt: str) -> int:
            async with session.post(stack.envoy.url + "/v1/completions", json={"model": "tiny", "prompt": prompt},
                                    headers={"x-llm-d-inference-fairness-id": tenant}) as response:
                await response.read()
                order.append(f"{tenant} {i}")
                return response.status

        async with aiohttp.ClientSession() as session:
            tasks = []
            for tenant, chars in (("heavy", 4000), ("light", 40)):
                tasks += [asyncio.create_task(send(session, tenant, i, f"{i} " + "x" * chars)) for i in range(8)]
                size = len(tasks)

                async def queued(size: int = size) -> bool:  # in this order: the heavy tenant's first
                    return (await series(stack)).get("llm_d_epp_flow_control_queue_size", 0) == size
                await eventually_async(queued, f"{size} queued", within=5)
            set_pod(stack, waiting=0)
            statuses = await asyncio.gather(*tasks)
        charged = await charged_tokens(stack)
        async with stack.picker.aio_channel() as channel:  # Explain shows what a next heavy request would weigh
            explained = await picker_pb2_grpc.PickerStub(channel).Explain(picker_pb2.ExplainRequest(
                path="/v1/completions", body=b'{"model": "tiny", "prompt": "' + b"x" * 4000 + b'"}',
                headers={"x-llm-d-inference-fairness-id": "heavy"}))
    assert statuses == [200] * 16
    assert dict(explained.admission) == {"flow_cost_tokens": 1000, "flow_charged_tokens": 8000}
    # what each flow was charged, as its metric says: its prompts' tokens (characters / 4; no max_tokens asked)
    assert charged == {"heavy": 8 * 1000, "light": 8 * 10}
    # a wave of dispatches may answer in any order: the light tenant's 8 among the first 10 answers (one heavy
    # request goes first, its tenant queued first; another may share a wave)
    assert sum(label.startswith("light") for label in order[:10]) == 8, order
