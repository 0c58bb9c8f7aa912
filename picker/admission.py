"""Admission control: priority from the objective, GIE's saturation detector, shedding and a bounded wait.

Shedding protects latency for important traffic: when the pool is saturated, sheddable requests
(priority < 0) get 429 + Retry-After at once; standard ones (priority 0) may wait up to `max_wait` for
capacity and then go through anyway (never lost); critical ones (priority > 0) never wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from picker.config import parse_duration
from picker.endpoints.state import Endpoint
from picker.requests import InferenceRequest, RequestError


@dataclass(slots=True)
class AdmissionConfig:
    """Thresholds as in GIE's saturation detector; keys in `from_dict` are camelCase like the YAML."""

    queue_threshold: float = 5.0  # waiting requests at which a pod counts as full
    kv_threshold: float = 0.8  # KV-cache utilisation at which a pod counts as full
    stale_threshold: float = 0.2  # seconds past the pod's scrape cadence; older metrics count as a full pod
    saturation_limit: float = 1.0  # pool saturated when the mean pod saturation reaches this
    objectives: dict[str, int] = field(default_factory=dict)  # objective name -> priority
    default_priority: int = 0
    max_wait: float = 0.0  # seconds a standard request may wait for capacity (0: route at once)
    poll_interval: float = 0.02  # how often a waiting request re-checks saturation
    retry_after: str = "1"  # Retry-After header value on a 429

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AdmissionConfig:
        data = dict(data or {})
        names = {
            "queueThreshold": "queue_threshold",
            "kvThreshold": "kv_threshold",
            "kvCacheThreshold": "kv_threshold",
            "staleThreshold": "stale_threshold",
            "saturationLimit": "saturation_limit",
            "objectives": "objectives",
            "defaultPriority": "default_priority",
            "maxWait": "max_wait",
            "pollInterval": "poll_interval",
            "retryAfter": "retry_after",
        }
        unknown = set(data) - set(names)
        if unknown:
            raise ValueError(f"unknown admission settings: {', '.join(sorted(unknown))}")
        kwargs: dict[str, Any] = {names[k]: v for k, v in data.items()}
        if "objectives" in kwargs:
            kwargs["objectives"] = _objectives(kwargs["objectives"])
        if "retry_after" in kwargs:
            kwargs["retry_after"] = str(kwargs["retry_after"])
        for key in ("queue_threshold", "kv_threshold", "saturation_limit"):
            if key in kwargs:
                kwargs[key] = float(kwargs[key])
        for key in ("stale_threshold", "max_wait", "poll_interval"):
            if key in kwargs:
                kwargs[key] = parse_duration(kwargs[key])
        if "default_priority" in kwargs:
            kwargs["default_priority"] = int(kwargs["default_priority"])
        config = cls(**kwargs)
        if config.queue_threshold <= 0 or config.kv_threshold <= 0 or config.poll_interval <= 0:
            raise ValueError("queueThreshold, kvThreshold and pollInterval must be positive")
        if config.max_wait < 0 or config.stale_threshold < 0:
            raise ValueError("maxWait and staleThreshold must not be negative")
        return config


def _objectives(value: Any) -> dict[str, int]:
    """{name: priority} or a list of {name, priority} (InferenceObjective-like)."""
    if isinstance(value, Mapping):
        return {str(k): int(v) for k, v in value.items()}
    out: dict[str, int] = {}
    for item in value or ():
        out[str(item["name"])] = int(item.get("priority", 0))
    return out


def pod_saturation(endpoint: Endpoint, now: float, config: AdmissionConfig) -> float:
    """max(waiting/queueThreshold, kv/kvThreshold); 1.0 when metrics are stale (we cannot tell): more than
    `stale_threshold` late for the pod's scrape cadence (a calm pod is scraped less often, not staler)."""
    m = endpoint.metrics
    if m.updated_at < 0 or endpoint.metrics_overdue(now) > config.stale_threshold:
        return 1.0
    return max(m.waiting / config.queue_threshold, m.kv_usage / config.kv_threshold)


def pool_saturation(candidates: Sequence[Endpoint], now: float, config: AdmissionConfig) -> float:
    """Mean pod saturation over the candidates (0.0 for none: an empty pool is a 503, not saturation)."""
    if not candidates:
        return 0.0
    return sum(pod_saturation(e, now, config) for e in candidates) / len(candidates)


class AdmissionController:
    """Decides whether a request is routed now, after a bounded wait, or shed with 429."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config if config is not None else AdmissionConfig()
        # Priorities of the pool's InferenceObjectives as the cluster declares them (Kubernetes discovery);
        # an objective named in the config wins.
        self.discovered_objectives: dict[str, int] = {}

    def set_discovered_objectives(self, priorities: dict[str, int]) -> None:
        self.discovered_objectives = dict(priorities)

    def priority_of(self, request: InferenceRequest) -> int:
        """Resolve and store request.priority from its objective (unknown objective: default priority)."""
        cfg = self.config
        priority = cfg.default_priority
        objective = request.objective
        if objective:
            priority = cfg.objectives.get(objective, self.discovered_objectives.get(objective, priority))
        request.priority = priority
        return priority

    def saturated(self, candidates: Sequence[Endpoint], now: float) -> bool:
        return pool_saturation(candidates, now, self.config) >= self.config.saturation_limit

    def _shed(self, request: InferenceRequest, level: float) -> RequestError:
        return RequestError(
            429,
            "saturated",
            f"pool saturated ({level:.2f} >= {self.config.saturation_limit:g}); request priority "
            f"{request.priority} is sheddable",
            headers={"retry-after": self.config.retry_after},
        )

    def check(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> bool:
        """Synchronous decision for simulated time: raises 429 for a shed request; returns whether the pool
        is saturated (a standard request may then be held by the caller for up to `max_wait`)."""
        priority = self.priority_of(request)
        level = pool_saturation(candidates, now, self.config)
        saturated = bool(candidates) and level >= self.config.saturation_limit
        if saturated and priority < 0:
            raise self._shed(request, level)
        return saturated

    async def admit(
        self,
        request: InferenceRequest,
        candidates_fn: Callable[[], Sequence[Endpoint]],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """Return when the request may be routed; raise 429 to shed it. Standard requests wait (polling)
        until saturation clears or `max_wait` passes, then go through regardless."""
        start = clock()
        saturated = self.check(request, candidates_fn(), start)
        if not saturated or request.priority != 0 or self.config.max_wait <= 0:
            return
        deadline = start + self.config.max_wait
        while True:
            now = clock()
            remaining = deadline - now
            if remaining <= 0:
                return
            await sleep(min(self.config.poll_interval, remaining))
            if not self.saturated(candidates_fn(), clock()):
                return
