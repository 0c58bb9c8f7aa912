"""Admission: objective priorities, GIE saturation maths, shedding, and the bounded wait for standard traffic."""

from __future__ import annotations

import asyncio
import random

import pytest

from picker.core.requests import ApiKind, InferenceRequest, RequestError
from picker.core.schema import ConfigError
from picker.endpoints.pool import EndpointPool
from picker.endpoints.saturation import (
    SaturationThresholds,
    dispatch_level,
    not_past_full,
    pod_saturation,
    pool_saturation,
)
from picker.endpoints.state import Endpoint, EndpointMetrics, EndpointState
from picker.routing.admission import AdmissionConfig, BoundedWait, Priorities
from picker.routing.director import Director
from picker.scheduling.config import build_scheduler

CONFIG = AdmissionConfig.from_dict({"objectives": {"batch": -1, "interactive": 0, "critical": 5}})


def pods(n: int, waiting: float = 0.0, kv: float = 0.0, at: float = 0.0) -> list[Endpoint]:
    out = []
    for i in range(n):
        e = Endpoint.from_address(f"10.0.1.{i + 1}:8000")
        e.metrics = EndpointMetrics(waiting=waiting, kv_usage=kv, updated_at=at)
        out.append(e)
    return out


def req(objective: str | None = None) -> InferenceRequest:
    """A request whose priority is resolved from its objective, as the director does before admission."""
    r = InferenceRequest("r", "m", api=ApiKind.COMPLETIONS, prompt_text="hello", objective=objective)
    r.priority = Priorities(CONFIG).of(r)
    return r


def test_priority_comes_from_the_objective() -> None:
    priorities = Priorities(CONFIG)
    for objective, priority in (("batch", -1), ("critical", 5), ("unknown", 0), (None, 0)):
        assert priorities.of(InferenceRequest("r", "m", objective=objective)) == priority
    listed = Priorities(AdmissionConfig.from_dict({"objectives": [{"name": "bg", "priority": -2}],
                                                   "defaultPriority": 1}))
    assert listed.of(InferenceRequest("r", "m", objective="other")) == 1
    assert listed.of(InferenceRequest("r", "m", objective="bg")) == -2
    listed.set_discovered({"bg": 7, "chat": 3})  # the config's objectives win over the cluster's
    assert listed.of(InferenceRequest("r", "m", objective="bg")) == -2
    assert listed.of(InferenceRequest("r", "m", objective="chat")) == 3


def test_saturation_is_gie_mean_of_max_with_stale_as_full() -> None:
    cfg = SaturationThresholds()
    fresh = pods(1, waiting=2.5, kv=0.2, at=10.0)[0]
    assert pod_saturation(fresh, 10.1, cfg) == pytest.approx(0.5)
    fresh.metrics.kv_usage = 0.6
    assert pod_saturation(fresh, 10.1, cfg) == pytest.approx(0.75)
    assert pod_saturation(fresh, 10.25, cfg) == 1.0  # older than 200 ms
    fresh.scrape_interval = 1.0  # a calm pod on the slow cadence: stale only 200 ms past its next scrape
    assert pod_saturation(fresh, 10.9, cfg) == pytest.approx(0.75)
    assert pod_saturation(fresh, 11.25, cfg) == 1.0
    assert pod_saturation(Endpoint.from_address("10.0.0.9:1"), 0.0, cfg) == 1.0  # never scraped
    idle = pods(1, at=10.0)[0]
    assert pool_saturation([fresh, idle], 10.1, cfg) == pytest.approx(0.375)
    assert pool_saturation([], 10.0, cfg) == 0.0


def test_a_degraded_pod_is_judged_by_our_own_sends_in_flow_control_only() -> None:
    """Metrics unreadable, pod reachable: admission counts it full (sheddable requests shed, as the reference
    does), flow control by the requests we sent it beyond those it ran at its last scrape."""
    cfg = SaturationThresholds()
    pod = pods(1, at=10.0)[0]
    pod.metrics.running = 2
    pod.state = EndpointState.DEGRADED
    for _ in range(4):
        pod.start_request(100, 10.0)
    assert pod_saturation(pod, 60.0, cfg) == 1.0
    assert pod_saturation(pod, 60.0, cfg, own_sends=True) == pytest.approx(2 / cfg.queue)
    assert dispatch_level([pod], 60.0, cfg) == pytest.approx(2 / cfg.queue)
    never = Endpoint.from_address("10.0.0.9:1")
    never.state = EndpointState.DEGRADED
    assert dispatch_level([never], 0.0, cfg) == 0.0


def go() -> bool:
    return True


def test_does_not_shed_by_default_even_when_saturated() -> None:
    gate = BoundedWait(CONFIG, clock=lambda: 0.0)
    full = pods(3, waiting=8, kv=0.95)
    assert gate.offer(req(), full, go) is None  # saturated, but standard traffic is routed (no maxWait)
    assert gate.offer(req("critical"), full, go) is None
    assert gate.saturated(full, 0.0)
    waiting = BoundedWait(AdmissionConfig(max_wait=1.0), clock=lambda: 0.0)
    hold = waiting.offer(req(), full, go)  # with a maxWait, standard traffic waits first
    assert hold is not None and hold.queued and hold.deadline == 1.0
    assert waiting.offer(req("critical"), full, go) is None  # critical never waits
    header_only = req()
    header_only.api = None
    assert waiting.offer(header_only, full, go) is None  # nothing to schedule: no wait
    result = build_scheduler(rng=random.Random(0)).schedule(req(), full, 0.0)
    assert len(result.ranked) == 3  # the saturation filter keeps everyone when all are saturated


def test_sheds_sheddable_request_when_all_pods_saturated() -> None:
    gate = BoundedWait(CONFIG, clock=lambda: 0.0)
    with pytest.raises(RequestError) as err:
        gate.offer(req("batch"), pods(3, waiting=5), go)
    assert err.value.status == 429 and err.value.code == "saturated"
    assert err.value.headers == {"retry-after": "1"}
    assert gate.offer(req("batch"), pods(3, waiting=4.9), go) is None  # just below: admitted
    mixed = pods(2, waiting=10) + pods(2)  # mean 1.0 from two full and two idle pods
    with pytest.raises(RequestError):
        gate.offer(req("batch"), mixed, go)
    assert gate.refusal(req("batch"), mixed, 0.0) is not None  # what Explain reports, taking nothing
    assert gate.offer(req("batch"), [], go) is None  # empty pool: the scheduler answers 503


class Released:
    """A held request's `go`: counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return True


def test_standard_request_waits_until_a_refreshed_pod_frees_capacity() -> None:
    now = [0.0]
    gate = BoundedWait(AdmissionConfig.from_dict({"maxWait": "500ms"}), clock=lambda: now[0])
    endpoints = pods(2, waiting=6)
    released = Released()
    hold = gate.offer(req(), endpoints, released)
    assert hold is not None and hold.deadline == pytest.approx(0.5)
    now[0] = 0.1
    endpoints[0].metrics = EndpointMetrics(waiting=6, updated_at=0.1)
    gate.pod_refreshed(endpoints[0])  # still saturated: held
    gate.kick()  # a request finished elsewhere: saturation reads the metrics only, still held
    assert released.calls == 0 and hold.queued
    now[0] = 0.2
    for e in endpoints:  # the queues drain
        e.metrics = EndpointMetrics(waiting=1, updated_at=0.2)
    gate.pod_refreshed(endpoints[1])
    assert released.calls == 1 and not hold.queued and not gate.waiting
    assert gate.expire(hold) is None and released.calls == 1  # its deadline later: gone already


def test_standard_request_goes_through_after_max_wait() -> None:
    gate = BoundedWait(AdmissionConfig(max_wait=0.3), clock=lambda: 0.0)
    released = Released()
    hold = gate.offer(req(), pods(2, waiting=9), released)
    assert hold is not None
    assert gate.expire(hold) is None  # never refused: the request is not lost, it goes now
    assert released.calls == 1 and not gate.waiting


def test_a_withdrawn_request_is_never_let_go() -> None:
    gate = BoundedWait(AdmissionConfig(max_wait=1.0), clock=lambda: 0.0)
    endpoints = pods(1, waiting=9)
    released = Released()
    hold = gate.offer(req(), endpoints, released)
    assert hold is not None
    gate.withdraw(hold)  # its client left
    endpoints[0].metrics = EndpointMetrics(updated_at=0.0)
    gate.kick()
    assert gate.expire(hold) is None and released.calls == 0 and not gate.waiting


def test_critical_never_waits_and_sheddable_is_shed_at_once() -> None:
    gate = BoundedWait(AdmissionConfig.from_dict({"maxWait": 1}), clock=lambda: 0.0)
    full = pods(2, waiting=9)
    assert gate.offer(req("critical"), full, go) is None
    with pytest.raises(RequestError) as err:
        gate.offer(req("batch"), full, go)
    assert err.value.status == 429 and not gate.waiting


async def test_the_director_holds_a_standard_request_for_its_max_wait_in_real_time() -> None:
    loop = asyncio.get_running_loop()
    pool = EndpointPool()
    endpoints = pods(1, waiting=9, at=loop.time())
    endpoints[0].scrape_interval = 60.0  # fresh for the whole test
    pool.set_endpoints(endpoints)
    gate = BoundedWait(AdmissionConfig(max_wait=0.05), clock=loop.time)
    director = Director(pool, build_scheduler(rng=random.Random(0)), gate=gate, clock=loop.time)
    request = req()
    start = loop.time()
    decision = await director.route(request)
    assert 0.045 <= loop.time() - start < 0.5  # held its maxWait, then routed anyway
    assert start <= decision.started_at < start + 0.04  # its duration counts from its arrival, the wait too


def test_config_parsing() -> None:
    cfg = AdmissionConfig.from_dict({"queueThreshold": 10, "kvCacheThreshold": 0.9, "staleThreshold": "200ms",
                                     "maxWait": "1.5s", "retryAfter": 2})
    assert (cfg.queue_threshold, cfg.kv_cache_threshold, cfg.stale_threshold, cfg.max_wait, cfg.retry_after) == (
        10.0, 0.9, 0.2, 1.5, "2")
    assert cfg.thresholds == SaturationThresholds(10.0, 0.9, 0.2)
    assert AdmissionConfig.from_dict({"kvThreshold": 0.7}).kv_cache_threshold == 0.7  # the older spelling
    assert AdmissionConfig.from_dict(None) == AdmissionConfig()
    with pytest.raises(ConfigError, match=r"^admission\.queue: unknown key"):
        AdmissionConfig.from_dict({"queue": 1})
    with pytest.raises(ConfigError, match=r"^admission\.queueThreshold: "):
        AdmissionConfig.from_dict({"queueThreshold": 0})
    with pytest.raises(ConfigError, match=r"^admission\.maxWait: 'soon' is not a duration"):
        AdmissionConfig.from_dict({"maxWait": "soon"})
    with pytest.raises(ConfigError, match=r"^admission\.objectives\.chat: "):
        AdmissionConfig.from_dict({"objectives": {"chat": "high"}})


@pytest.mark.parametrize("seed", range(5))
def test_the_filters_fast_path_is_the_saturation_definition(seed: int) -> None:
    """`not_past_full` (the saturation filter's loop) keeps exactly the pods `pod_saturation` puts at <= 1."""
    rng = random.Random(seed)
    thresholds = SaturationThresholds(queue=rng.choice((1.0, 3.0, 5.0)), kv_cache=rng.choice((0.5, 0.8)), stale=0.2)
    endpoints = []
    for i in range(200):
        e = Endpoint.from_address(f"10.0.{i // 250}.{i % 250 + 1}:8000")
        e.metrics = EndpointMetrics(waiting=float(rng.randint(0, 8)), kv_usage=rng.choice((0.0, 0.5, 0.8, 0.95)),
                                    updated_at=rng.choice((-1.0, 9.0, 9.5, 10.0)))
        e.scrape_interval = rng.choice((0.0, 0.1, 1.0))
        endpoints.append(e)
    expected = [e for e in endpoints if pod_saturation(e, 10.0, thresholds) <= 1.0]
    assert not_past_full(endpoints, 10.0, thresholds) == expected
