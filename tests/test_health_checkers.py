"""Who health-checks a picker, and when each heard NOT_SERVING: what decides when a stopping replica may refuse
new streams (picker/serving/health.py)."""

from __future__ import annotations

import math

from grpc_health.v1 import health_pb2

from picker.serving.health import CHECKERS_FORGOTTEN_AFTER_S, CheckedHealth, checker_host

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_checkers_are_told_apart_by_host_not_by_connection() -> None:
    assert checker_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert checker_host("ipv6:[::1]:51234") == "[::1]"
    assert checker_host("unix:/run/envoy.sock") == "unix:/run/envoy.sock"


async def test_the_wait_ends_only_when_every_checker_has_heard_not_serving() -> None:
    clock = Clock()
    checked = CheckedHealth(clock)
    checked.answered("10.0.0.1", SERVING)
    checked.answered("10.0.0.2", SERVING)
    clock.now += 1
    stopping = clock.now
    assert checked.all_told_since(stopping) is None  # neither has heard it
    clock.now += 0.5
    checked.answered("10.0.0.1", NOT_SERVING)
    assert checked.all_told_since(stopping) is None  # the second still routes here
    clock.now += 1.0
    checked.answered("10.0.0.2", NOT_SERVING)
    assert checked.all_told_since(stopping) == clock.now  # the last to hear it, heard it now


async def test_an_answer_from_before_the_stop_does_not_count() -> None:
    clock = Clock()
    checked = CheckedHealth(clock)
    checked.answered("10.0.0.1", NOT_SERVING)  # not ready earlier (an empty pool), then serving again
    clock.now += 1
    assert checked.all_told_since(clock.now) is None


async def test_with_no_checker_or_only_long_gone_ones_nothing_is_waited_for() -> None:
    clock = Clock()
    checked = CheckedHealth(clock)
    assert checked.all_told_since(clock.now) == -math.inf
    checked.answered("10.0.0.9", SERVING)  # a gateway removed since
    clock.now += CHECKERS_FORGOTTEN_AFTER_S + 1
    assert checked.all_told_since(clock.now) == -math.inf
