"""Flow control on an injected clock: strict priority between bands, round-robin between flows, FCFS inside a
flow, bounds, TTL expiry, one-at-a-time dispatch as room frees, and wake-ups that come from events only."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest

from picker.core.headers import DROPPED_REASON
from picker.core.requests import InferenceRequest, RequestError
from picker.endpoints.saturation import SaturationThresholds, dispatch_level
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.flowcontrol.controller import FlowController, FlowSettings
from picker.flowcontrol.queues import FlowQueues, QueueFull
from picker.flowcontrol.slots import RunningSlots
from picker.routing.director import through_gate


def through(fc: FlowController, r: InferenceRequest) -> Coroutine[Any, Any, None]:
    """The request through the controller as the director's route waits on it."""
    return through_gate(fc, lambda go: fc.offer(r, (), go), fc.clock)


def queues(max_requests: int = 100, max_tokens: int = 10_000) -> FlowQueues[str]:
    return FlowQueues(max_requests, max_tokens)


def push(q: FlowQueues[str], name: str, priority: int = 0, flow: str = "a", tokens: int = 10,
         now: float = 0.0, ttl: float = 5.0) -> None:
    q.push(name, priority=priority, flow=flow, tokens=tokens, size_bytes=tokens * 4, now=now, ttl=ttl)


def drain(q: FlowQueues[str]) -> list[str]:
    out = []
    while (w := q.pop()) is not None:
        out.append(w.item)
    return out


def test_bands_go_by_strict_priority_flows_by_turns_requests_in_order() -> None:
    q = queues()
    for name, priority, flow in (("s1", 0, "a"), ("s2", 0, "a"), ("c1", 5, "x"), ("s3", 0, "b"), ("c2", 5, "x"),
                                 ("s4", 0, "b"), ("s5", 0, "a"), ("h1", 9, "x")):
        push(q, name, priority, flow)
    assert drain(q) == ["h1", "c1", "c2", "s1", "s3", "s2", "s4", "s5"]
    assert len(q) == 0 and q.band_usage() == {}


def test_ten_to_one_offered_load_gets_equal_turns_while_both_are_backlogged() -> None:
    q = queues(max_requests=1000)
    for i in range(100):
        push(q, f"big-{i}", flow="big")
        if i % 10 == 0:
            push(q, f"small-{i}", flow="small")
    served = Counter(w.flow for w in (q.pop() for _ in range(20)) if w is not None)
    assert served == {"big": 10, "small": 10}


def test_by_tokens_a_flow_of_large_prompts_gets_the_same_tokens_not_the_same_turns() -> None:
    """Token fairness: each dispatch charges its flow (as the controller does); the flow served fewer tokens goes."""
    q: FlowQueues[str] = FlowQueues(1000, 10**9, fairness="tokens")
    for i in range(40):
        push(q, f"heavy-{i}", flow="heavy", tokens=8000)
        push(q, f"light-{i}", flow="light", tokens=200)
    served: Counter[str] = Counter()
    for _ in range(41):
        w = q.pop()
        assert w is not None
        q.charge(w.flow, w.tokens)
        served[w.flow] += w.tokens
    assert served["light"] == 40 * 200 and served["heavy"] == 8000  # the light flow drained first, by tokens
    by_turns = queues(max_requests=1000, max_tokens=10**9)
    for i in range(40):
        push(by_turns, f"heavy-{i}", flow="heavy", tokens=8000)
        push(by_turns, f"light-{i}", flow="light", tokens=200)
    assert Counter(w.flow for w in (by_turns.pop() for _ in range(40)) if w is not None) == {"heavy": 20, "light": 20}


def test_a_flow_idle_for_a_while_cannot_spend_credit_it_banked() -> None:
    """A flow that starts waiting is lifted to the least counter of the flows waiting: it takes turns from now on,
    not all the service it did not use while idle."""
    q: FlowQueues[str] = FlowQueues(1000, 10**9, fairness="tokens")
    for i in range(10):
        push(q, f"busy-{i}", flow="busy", tokens=1000)
    for _ in range(5):
        w = q.pop()
        assert w is not None
        q.charge(w.flow, w.tokens)  # busy: 5,000 served
    for i in range(10):
        push(q, f"new-{i}", flow="new", tokens=1000)  # lifted to busy's 5,000, not 0
    order = []
    for _ in range(6):
        w = q.pop()
        assert w is not None
        q.charge(w.flow, w.tokens)
        order.append(w.flow)
    assert order.count("new") == 3 and order.count("busy") == 3, order
    with pytest.raises(ValueError, match="fairness 'bytes'"):
        FlowQueues(10, 10, fairness="bytes")  # type: ignore[arg-type]


async def test_the_controller_charges_what_it_lets_through_at_once_too() -> None:
    """Under token fairness a request that goes at once (room in the pool) is charged like a dispatched one."""
    pods = [Endpoint.from_address("10.0.0.1:8000")]
    pods[0].metrics = EndpointMetrics(waiting=0, running=0, updated_at=0.0)  # room
    fc = FlowController(FlowSettings(fairness="tokens", output_token_weight=2.0),
                        SaturationThresholds(queue=5, kv_cache=0.8, stale=1e9), lambda: pods, clock=lambda: 0.0)
    r = InferenceRequest(request_id="1", model="m", prompt_text="x" * 400, max_tokens=10, fairness_id="t")
    await through(fc, r)
    assert fc.queues.served["t"] == fc.cost(r) == 400 / fc.settings.chars_per_token + 20


def test_bounds_refuse_and_a_lone_large_request_still_queues() -> None:
    q = queues(max_requests=2, max_tokens=100)
    push(q, "a", tokens=60)
    with pytest.raises(QueueFull):
        push(q, "b", tokens=50)  # 110 tokens > 100
    push(q, "c", tokens=40)
    with pytest.raises(QueueFull):
        push(q, "d", tokens=1)  # two requests already
    push(q, "other-band", priority=1, tokens=10)  # bounds are per band
    empty = queues(max_tokens=100)
    push(empty, "huge", tokens=5000)  # alone in its band: queues (refusing it would refuse it forever)
    assert q.band_usage() == {0: (2, 100, 400), 1: (1, 10, 40)}


def test_expiry_and_withdrawal_leave_the_rest_in_order() -> None:
    q = queues()
    push(q, "old", now=0.0, ttl=1.0)
    push(q, "young", now=0.5, ttl=1.0)
    push(q, "other", flow="b", now=0.2, ttl=1.0)
    assert [w.item for w in q.expired(1.25)] == ["old", "other"]
    assert drain(q) == ["young"]


def pod(i: int, waiting: float = 0.0, running: float = 0.0, now: float = 0.0) -> Endpoint:
    e = Endpoint.from_address(f"10.0.0.{i}:8000")
    e.metrics = EndpointMetrics(waiting=waiting, running=running, updated_at=now)
    e.scrape_interval = 1.0
    return e


def test_dispatch_level_counts_what_we_sent_and_what_is_let_through() -> None:
    thresholds = SaturationThresholds(queue=5, kv_cache=0.8, stale=0.2)
    a, b = pod(1, waiting=1, running=2), pod(2)
    b.in_flight = 4  # sent by us, not running yet: waiting as far as the pod is concerned
    assert dispatch_level([a, b], 0.0, thresholds) == pytest.approx((1 / 5 + 4 / 5) / 2)
    assert dispatch_level([a, b], 0.0, thresholds, pending=5) == pytest.approx((1 / 5 + 4 / 5 + 1) / 2)
    assert dispatch_level([a, b], 5.0, thresholds) == 1.0  # metrics far past their cadence: full
    assert dispatch_level([], 0.0, thresholds) == 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(pods: list[Endpoint], clock: Clock, ttl: float = 5.0, max_requests: int = 100) -> FlowController:
    return FlowController(FlowSettings(queue_ttl=ttl, max_requests_per_band=max_requests),
                          SaturationThresholds(queue=5, kv_cache=0.8, stale=1e9), lambda: pods, clock=clock)


def request(name: str, priority: int = 0, flow: str | None = None) -> InferenceRequest:
    r = InferenceRequest(request_id=name, model="m", prompt_text="x" * 40)
    r.priority, r.fairness_id = priority, flow
    return r


async def test_requests_wait_while_the_pool_is_full_and_go_best_first_one_at_a_time() -> None:
    clock = Clock()
    full = pod(1, waiting=10)
    fc = controller([full], clock)
    order: list[str] = []

    async def admit(r: InferenceRequest) -> None:
        await through(fc, r)
        order.append(r.request_id)
        full.in_flight += 1  # placed: the pod's in-flight count shows it
        fc.placed()

    tasks = [asyncio.create_task(admit(request(name, priority))) for name, priority in
             (("std-1", 0), ("crit-1", 2), ("std-2", 0), ("crit-2", 2))]
    await asyncio.sleep(0)
    assert order == [] and len(fc.queues) == 4  # no room: all wait
    full.metrics = EndpointMetrics(waiting=0, running=0, updated_at=0.0)
    fc.kick()  # a scrape shows room: in_flight - running counts each placed request as waiting again
    await asyncio.gather(*tasks)
    assert order == ["crit-1", "crit-2", "std-1", "std-2"]
    assert fc.unplaced == 0


def test_with_peers_each_replica_takes_its_share_of_the_room_until_the_next_sync() -> None:
    """Four replicas share their load: between two syncs each may let through a quarter of the room, as the
    three others are taken to let through as many as it does; a sync shows their real counts."""
    clock = Clock()
    p = pod(1)
    fc = controller([p], clock)
    fc.load_synced(3)
    p.in_flight = 1  # level 0.2: room for four more before 1.0, one for each replica
    assert fc.offer(request("r0"), (), lambda: True) is None
    fc.placed()
    p.start_request(10, 0.0)  # placed: ours shows at once; the level counts the three peers' likely ones too
    waiter = fc.offer(request("r1"), (), lambda: True)
    assert waiter is not None and waiter.item.dispatched is False
    p.set_peer_load(1, 10)  # the sync: the peers had let through one request, not three
    fc.load_synced(3)
    assert waiter.item.dispatched


async def test_room_for_two_lets_two_through_and_the_rest_on_release() -> None:
    clock = Clock()
    p = pod(1, waiting=0, running=0)
    fc = controller([p], clock)
    p.in_flight = 3  # level 3/5 = 0.6: room for two more before 1.0
    admitted: list[str] = []

    async def admit(name: str) -> None:
        await through(fc, request(name))
        admitted.append(name)
        p.in_flight += 1
        fc.placed()

    tasks = [asyncio.create_task(admit(f"r{i}")) for i in range(4)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert admitted == ["r0", "r1"] and len(fc.queues) == 2
    p.in_flight -= 1  # one finished (the director kicks on release)
    fc.kick()
    for _ in range(5):
        await asyncio.sleep(0)
    assert admitted == ["r0", "r1", "r2"]
    p.in_flight -= 2
    fc.kick()
    await asyncio.gather(*tasks)
    assert admitted == ["r0", "r1", "r2", "r3"]


async def test_sheddable_is_refused_at_once_full_bands_and_ttl_with_reasons() -> None:
    clock = Clock()
    fc = controller([pod(1, waiting=10)], clock, ttl=0.05, max_requests=1)
    with pytest.raises(RequestError) as shed:
        await through(fc, request("batch", priority=-1))
    assert (shed.value.status, shed.value.code) == (429, "saturated")
    assert shed.value.headers[DROPPED_REASON] == "rejected-saturated" and shed.value.headers["retry-after"]
    waiting = asyncio.create_task(through(fc, request("std")))
    await asyncio.sleep(0)
    with pytest.raises(RequestError) as full:
        await through(fc, request("std-2"))
    assert (full.value.status, full.value.code) == (429, "queue_full")
    with pytest.raises(RequestError) as expired:
        await waiting  # nothing frees room: its TTL (50 ms, the loop's timer) passes
    assert (expired.value.status, expired.value.code) == (503, "queue_ttl_expired")
    assert expired.value.headers[DROPPED_REASON] == "rejected-ttl-expired"
    assert len(fc.queues) == 0


async def test_a_client_that_leaves_while_queued_is_withdrawn() -> None:
    clock = Clock()
    p = pod(1, waiting=10)
    fc = controller([p], clock)
    task = asyncio.create_task(through(fc, request("gone")))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(fc.queues) == 0
    p.metrics = EndpointMetrics(updated_at=0.0)
    fc.kick()
    assert fc.unplaced == 0  # nobody was let through for it


def test_envoy_config_and_the_picker_keep_the_queue_ttl_below_envoys_message_timeout(
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from picker.cli import main
    from picker.serving.config import add_arguments, resolve
    assert main(["envoy-config", "--message-timeout", "3s"]) == 2
    assert "must exceed the picker's queue TTL --queue-ttl 4s" in capsys.readouterr().err
    assert main(["envoy-config", "--message-timeout", "8s", "--queue-ttl", "6s"]) == 0
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    notes: list[str] = []
    resolve(parser.parse_args(["--endpoints", "127.0.0.1:8000", "--config-text",
                               "admission: {flowControl: {enabled: true, queueTtl: 6s}}"]), notes)
    assert len(notes) == 1 and "queueTtl 6s is not below the 5s ext_proc message_timeout" in notes[0]
    notes.clear()
    resolve(parser.parse_args(["--endpoints", "127.0.0.1:8000", "--config-text",
                               "admission: {flowControl: {enabled: true, criticalSlotShare: 0.5}}"]), notes)
    assert len(notes) == 1 and "criticalSlotShare without maxRunningPerPod" in notes[0]
    notes.clear()
    resolve(parser.parse_args(["--endpoints", "127.0.0.1:8000", "--config-text", "admission: {flowControl: "
                               "{enabled: true, criticalSlotShare: 0.5, maxRunningPerPod: 8}}"]), notes)
    assert notes == []


async def test_room_above_the_standard_ceiling_is_held_back_for_critical_requests() -> None:
    clock = Clock()
    p = pod(1)
    p.in_flight = 2  # level 2/5 = 0.4: above a 0.3 standard ceiling, below the limit
    fc = FlowController(FlowSettings(standard_ceiling=0.3), SaturationThresholds(queue=5, stale=1e9), lambda: [p],
                        clock=clock)
    standard = asyncio.create_task(through(fc, request("std")))
    await asyncio.sleep(0)
    assert not standard.done() and len(fc.queues) == 1  # held back
    await through(fc, request("crit", priority=3))  # goes at once
    fc.placed()
    p.in_flight = 1  # 0.2: under the ceiling
    fc.kick()
    await standard
    assert len(fc.queues) == 0


async def test_a_queued_requests_duration_counts_from_its_arrival() -> None:
    import random

    from picker.core.requests import ApiKind
    from picker.endpoints.pool import EndpointPool
    from picker.routing.director import Director
    from picker.scheduling.config import build_scheduler

    clock = Clock()
    full = pod(1, waiting=10)
    pool = EndpointPool()
    pool.set_endpoints([full])
    fc = FlowController(FlowSettings(), SaturationThresholds(queue=5, stale=1e9), pool.ready, clock=clock)
    director = Director(pool, build_scheduler(rng=random.Random(0)), clock=clock, gate=fc)
    r = request("queued")
    r.api = ApiKind.COMPLETIONS  # a request with a body (has_body follows the API)
    routed = asyncio.create_task(director.route(r))
    await asyncio.sleep(0)
    clock.now = 2.5  # it waited
    full.metrics = EndpointMetrics(waiting=0, updated_at=2.5)
    fc.kick()
    decision = await routed
    assert decision.started_at == 0.0 and decision.endpoint is full


def test_token_budgets_refill_per_minute_and_bound_their_flows() -> None:
    from picker.flowcontrol.controller import TokenBudgets
    budgets = TokenBudgets(per_minute=600, max_flows=2)  # 10 tokens a second
    assert budgets.take("a", 500, now=0.0) == 0
    assert budgets.take("a", 200, now=0.0) == pytest.approx(10.0)  # 100 left, 100 more in 10 s
    assert budgets.take("a", 200, now=10.0) == 0  # refilled meanwhile (the refused try took nothing)
    assert budgets.take("b", 600, now=10.0) == 0 and budgets.take("c", 1, now=10.0) == 0
    assert budgets.take("a", 600, now=10.0) == 0  # "a" was dropped for "c" (2 flows kept): a full bucket again


async def test_a_flow_over_its_budget_is_refused_and_others_are_not() -> None:
    clock = Clock()
    fc = FlowController(FlowSettings(tokens_per_minute_per_flow=20), SaturationThresholds(queue=5, stale=1e9),
                        lambda: [pod(1)], clock=clock)
    await through(fc, request("first", flow="tenant-a"))  # 40 characters: 10 tokens
    fc.placed()
    await through(fc, request("second", flow="tenant-a"))
    fc.placed()
    with pytest.raises(RequestError) as refused:
        await through(fc, request("third", flow="tenant-a"))
    assert (refused.value.status, refused.value.code) == (429, "token_budget_exceeded")
    assert refused.value.headers["retry-after"] == "30" and \
        refused.value.headers[DROPPED_REASON] == "rejected-token-budget"
    await through(fc, request("other", flow="tenant-b"))  # its own budget


def test_a_pods_running_capacity_is_learned_once_it_has_shown_a_queue() -> None:
    slots = RunningSlots()
    a = pod(1, running=4)
    slots.observe(a)
    assert slots.capacity(a) is None  # running 4 with nothing waiting: maybe it could run more
    a.metrics = EndpointMetrics(running=3, waiting=2, updated_at=0.0)  # caught between two requests
    slots.observe(a)
    assert slots.capacity(a) == 4
    a.metrics = EndpointMetrics(running=6, updated_at=0.0)  # ran more later (its KV cache had room): it can
    slots.observe(a)
    assert slots.capacity(a) == 6
    a.metrics = EndpointMetrics(running=1, updated_at=0.0)
    slots.observe(a)
    assert slots.capacity(a) == 6
    b = pod(2)
    assert slots.free([a, b], 0) is None  # b's capacity unknown: nothing can be held back
    assert RunningSlots(per_pod=8).free([a, b], 0) == (7 + 8, 16)


def test_a_pods_use_is_what_it_reports_or_what_we_sent_it_whichever_is_more() -> None:
    slots = RunningSlots(per_pod=4)
    a, b = pod(1, running=2, waiting=1), pod(2, running=1)
    b.in_flight = 3  # our sends show before the next scrape does
    assert slots.free([a, b], 0) == (1 + 1, 8)
    assert slots.free([a, b], 1) == (1, 8)  # let through, not yet placed


async def test_slots_held_back_for_critical_requests() -> None:
    clock = Clock()
    a, b = pod(1), pod(2)
    fc = FlowController(FlowSettings(critical_slot_share=0.25, max_running_per_pod=4),
                        SaturationThresholds(queue=5, stale=1e9), lambda: [a, b], clock=clock)
    a.in_flight, b.in_flight = 4, 2  # 2 of 8 slots free: the 2 held back (25 %)
    standard = asyncio.create_task(through(fc, request("std")))
    await asyncio.sleep(0)
    assert not standard.done()
    with pytest.raises(RequestError) as refused:  # sheddable: no room for it, at once
        await through(fc, request("shed", priority=-1))
    assert refused.value.status == 429
    await through(fc, request("crit", priority=3))  # takes a held slot at once
    fc.placed()
    b.in_flight = 3
    await through(fc, request("crit2", priority=3))
    fc.placed()
    b.in_flight = 4  # every slot taken: critical requests wait too, here rather than in a pod's queue
    critical = asyncio.create_task(through(fc, request("crit3", priority=3)))
    await asyncio.sleep(0)
    assert not critical.done()
    a.in_flight = 3  # one finished
    fc.kick()
    await critical  # the critical one first
    fc.placed()
    assert not standard.done()
    a.in_flight, b.in_flight = 1, 2  # 5 free: above the 2 held back
    fc.kick()
    await standard


async def test_without_known_capacities_nothing_is_held_back() -> None:
    clock = Clock()
    a = pod(1, running=2)
    fc = FlowController(FlowSettings(critical_slot_share=0.5), SaturationThresholds(queue=5, stale=1e9),
                        lambda: [a], clock=clock)
    await through(fc, request("std"))  # capacity unknown: the level alone decides
    fc.placed()
    a.metrics = EndpointMetrics(running=2, waiting=1, updated_at=0.0)  # a queue: it runs 2 at most
    fc.pod_refreshed(a)
    a.metrics = EndpointMetrics(running=1, updated_at=0.0)
    a.in_flight = 1
    standard = asyncio.create_task(through(fc, request("std2")))
    await asyncio.sleep(0)
    assert not standard.done()  # 1 of 2 slots free, and that one is held back
    standard.cancel()


def test_requests_that_ended_since_the_scrape_free_their_slots() -> None:
    slots = RunningSlots(per_pod=4)
    a = pod(1, running=4)
    a.in_flight = 4
    slots.observe(a)
    assert slots.free([a], 0) == (0, 4)
    a.finish_request(0)
    a.finish_request(0)  # two answered: the scrape still says 4 running
    assert slots.free([a], 0) == (2, 4)


async def test_a_request_let_through_for_a_free_slot_goes_to_a_pod_that_has_one() -> None:
    """The pods differ only in load the scheduler might not weigh first (here: the busy pod holds the prompt's
    prefix); with slots held back the request still lands where a slot is free, not in the full pod's queue."""
    import random

    from picker.core.requests import ApiKind
    from picker.endpoints.pool import EndpointPool
    from picker.routing.admission import AdmissionConfig, Priorities
    from picker.routing.director import Director
    from picker.scheduling.config import build_scheduler

    clock = Clock()
    busy, idle = pod(1), pod(2)
    pool = EndpointPool()
    pool.set_endpoints([busy, idle])
    fc = FlowController(FlowSettings(critical_slot_share=0.25, max_running_per_pod=2),
                        SaturationThresholds(queue=5, stale=1e9), pool.ready, clock=clock)
    critical = Priorities(AdmissionConfig.model_validate({"defaultPriority": 3}))  # every request critical
    director = Director(pool, build_scheduler(rng=random.Random(0)), priorities=critical, clock=clock, gate=fc)
    warm = request("warm", priority=3)
    warm.api, warm.prompt_text = ApiKind.COMPLETIONS, "a long shared system prompt " * 40
    first = await director.route(warm)
    assert fc.slots.open_on([busy, idle]) == [busy, idle]
    director.release(first)
    held = first.endpoint
    other = idle if held is busy else busy
    held.in_flight, other.in_flight = 2, 1  # the pod that holds the prefix is full, the other has a slot
    again = request("again", priority=3)
    again.api, again.prompt_text = ApiKind.COMPLETIONS, warm.prompt_text
    decision = await director.route(again)
    assert again.priority == 3 and decision.endpoint is other
    assert fc.with_room([held]) == [held]  # no pod with room: the candidates stay as they were
