"""gRPC health that remembers who asks, so a stopping replica knows when its load balancers have heard it is going.

A replica stopping in a rolling restart reports NOT_SERVING, but Envoy keeps sending it streams until its own health
check has read that answer (up to one check interval later); a stream refused meanwhile takes Envoy's fail-open
route and loses its prefix affinity. A lull in the traffic says nothing about that: at 8 streams a second per
replica a quarter-second without one comes every few seconds while Envoy still routes here. The answers given to
the checkers do: once every host that has been health-checking this replica was told NOT_SERVING, and no stream
came for a moment after, nothing is still on its way.

Checkers are told apart by host, not by connection: the kubelet opens a connection per probe, Envoy keeps one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health, health_pb2

# A host that has not asked for this long before the stop began is no longer a checker (a removed gateway).
CHECKERS_FORGOTTEN_AFTER_S = 30.0


def checker_host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:/path")."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0]
    return peer


class CheckedHealth(health.aio.HealthServicer):
    """The standard health service, plus when each checking host last asked and was last told NOT_SERVING."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._asked: dict[str, float] = {}
        self._told_not_serving: dict[str, float] = {}
        self._answered = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        response: health_pb2.HealthCheckResponse = await super().Check(request, context)  # aborts on unknown
        self.answered(checker_host(context.peer()), response.status)
        return response

    def answered(self, host: str, status: int) -> None:
        now = self._clock()
        self._asked[host] = now
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            self._told_not_serving[host] = now
        else:
            self._told_not_serving.pop(host, None)
        self._answered.set()

    def all_told_since(self, since: float) -> float | None:
        """When the last of the checkers was told NOT_SERVING, if every host that has been asking (up to
        CHECKERS_FORGOTTEN_AFTER_S before `since`) was told so at or after `since`; None while one has not heard
        it yet; -inf when no one health-checks this replica."""
        checkers = [host for host, at in self._asked.items() if at >= since - CHECKERS_FORGOTTEN_AFTER_S]
        if not checkers:
            return -math.inf
        told = [self._told_not_serving.get(host, -math.inf) for host in checkers]
        return max(told) if min(told) >= since else None

    async def next_answer(self) -> None:
        """Return after the next health answer."""
        self._answered.clear()
        await self._answered.wait()
