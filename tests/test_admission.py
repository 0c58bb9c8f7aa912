"""Admission: objective priorities, GIE saturation maths, shedding, and the bounded wait for standard traffic."""

from __future__ import annotations

import asyncio
import random

import pytest

from picker.admission import AdmissionConfig, AdmissionController, Priorities
from picker.endpoints.state import Endpoint, EndpointMetrics, EndpointState
from picker.requests import InferenceRequest, RequestError
from picker.saturation import (
    SaturationThresholds,
    dispatch_level,
    not_past_full,
    pod_saturation,
    pool_saturation,
)
from picker.scheduling.config import build_scheduler
from picker.schema import ConfigError

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
    r = InferenceRequest("r", "m", prompt_text="hello", objective=objective)
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


def test_does_not_shed_by_default_even_when_saturated() -> None:
    ctl = AdmissionController(CONFIG)
    full = pods(3, waiting=8, kv=0.95)
    assert ctl.check(req(), full, 0.0) is False  # saturated, but standard traffic is routed (no maxWait)
    assert ctl.check(req("critical"), full, 0.0) is False
    assert ctl.saturated(full, 0.0)
    waiting = AdmissionController(AdmissionConfig(max_wait=1.0))
    assert waiting.check(req(), full, 0.0) is True  # with a maxWait, standard traffic waits first
    assert waiting.check(req("critical"), full, 0.0) is False  # critical never waits
    result = build_scheduler(rng=random.Random(0)).schedule(req(), full, 0.0)
    assert len(result.ranked) == 3  # the saturation filter keeps everyone when all are saturated


def test_sheds_sheddable_request_when_all_pods_saturated() -> None:
    ctl = AdmissionController(CONFIG)
    with pytest.raises(RequestError) as err:
        ctl.check(req("batch"), pods(3, waiting=5), 0.0)
    assert err.value.status == 429 and err.value.code == "saturated"
    assert err.value.headers == {"retry-after": "1"}
    assert ctl.check(req("batch"), pods(3, waiting=4.9), 0.0) is False  # just below: admitted
    mixed = pods(2, waiting=10) + pods(2)  # mean 1.0 from two full and two idle pods
    with pytest.raises(RequestError):
        ctl.check(req("batch"), mixed, 0.0)
    assert ctl.check(req("batch"), [], 0.0) is False  # empty pool: the scheduler answers 503


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


async def test_standard_request_waits_until_capacity_frees() -> None:
    ctl = AdmissionController(AdmissionConfig.from_dict({"maxWait": "500ms", "pollInterval": "50ms"}))
    t = FakeTime()
    endpoints = pods(2, waiting=6)

    def candidates() -> list[Endpoint]:
        if t.now >= 0.2:  # the queue drains after 200 ms of (simulated) time
            for e in endpoints:
                e.metrics = EndpointMetrics(waiting=1, updated_at=t.now)
        else:
            for e in endpoints:
                e.metrics.updated_at = t.now
        return endpoints

    assert ctl.check(req(), candidates(), t.clock())
    await ctl.wait_for_capacity(candidates, t.clock, t.sleep)
    assert t.now == pytest.approx(0.2)
    assert all(s == pytest.approx(0.05) for s in t.sleeps)


async def test_standard_request_goes_through_after_max_wait() -> None:
    ctl = AdmissionController(AdmissionConfig(max_wait=0.3, poll_interval=0.08))
    t = FakeTime()
    endpoints = pods(2, waiting=9)

    def candidates() -> list[Endpoint]:
        for e in endpoints:
            e.metrics.updated_at = t.now
        return endpoints

    assert ctl.check(req(), candidates(), t.clock())
    await ctl.wait_for_capacity(candidates, t.clock, t.sleep)  # never raises: the request is not lost
    assert t.now == pytest.approx(0.3)
    assert sum(t.sleeps) == pytest.approx(0.3) and t.sleeps[-1] == pytest.approx(0.06)


async def test_critical_never_waits_and_sheddable_is_shed_at_once() -> None:
    ctl = AdmissionController(AdmissionConfig.from_dict({"maxWait": 1}))
    t = FakeTime()
    full = pods(2, waiting=9)
    assert ctl.check(req("critical"), full, t.clock()) is False
    with pytest.raises(RequestError) as err:
        ctl.check(req("batch"), full, t.clock())
    assert err.value.status == 429 and t.sleeps == []


async def test_wait_with_real_sleep_is_bounded() -> None:
    ctl = AdmissionController(AdmissionConfig(max_wait=0.05, poll_interval=0.01))
    loop = asyncio.get_running_loop()
    endpoints = pods(1, waiting=9)

    def candidates() -> list[Endpoint]:
        endpoints[0].metrics.updated_at = loop.time()
        return endpoints

    start = loop.time()
    assert ctl.check(req(), candidates(), start)
    await ctl.wait_for_capacity(candidates, loop.time)
    assert 0.045 <= loop.time() - start < 0.5


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
