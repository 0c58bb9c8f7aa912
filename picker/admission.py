"""Admission control: GIE's saturation detector, shedding and a bounded wait; priorities from objectives.

Shedding protects latency for important traffic: when the pool is saturated, sheddable requests
(priority < 0) get 429 + Retry-After at once; standard ones (priority 0) may wait up to `maxWait` for
capacity and then go through anyway (never lost); critical ones (priority > 0) never wait. The director
resolves each request's priority (`Priorities`) before admission reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from pydantic import AliasChoices, Field, PrivateAttr, field_validator

from picker.endpoints.state import Endpoint
from picker.flowcontrol.controller import FlowSettings
from picker.requests import InferenceRequest, RequestError
from picker.saturation import SaturationThresholds, pool_saturation
from picker.schema import Duration, Section, decode

_DEFAULTS = SaturationThresholds()
_FLOW = FlowSettings()


class FlowControlSection(Section):
    """`admission.flowControl`: queue what the pool has no room for (picker.flowcontrol) instead of the bounded
    wait (`maxWait`); off unless `enabled`. Defaults: the controller's own (FlowSettings)."""

    enabled: bool = False
    queue_ttl: Duration = Field(_FLOW.queue_ttl, gt=0)  # below Envoy's ext_proc message_timeout (5 s in our templates)
    max_requests_per_band: int = Field(_FLOW.max_requests_per_band, gt=0)
    max_tokens_per_band: int = Field(_FLOW.max_tokens_per_band, gt=0)  # estimated prompt tokens waiting per priority
    standard_ceiling: float = Field(_FLOW.standard_ceiling, gt=0, le=1)  # priority <= 0 below this share of the limit
    tokens_per_minute_per_flow: int = Field(_FLOW.tokens_per_minute_per_flow, ge=0)  # a flow's token budget (0: none)
    critical_slot_share: float = Field(_FLOW.critical_slot_share, ge=0, lt=1)  # slots kept free for critical ones
    max_running_per_pod: int = Field(_FLOW.max_running_per_pod, ge=0)  # pods' --max-num-seqs; 0: learned


class AdmissionConfig(Section):
    """The `admission:` config section (camelCase keys, as GIE's saturation detector names them)."""

    queue_threshold: float = Field(_DEFAULTS.queue, gt=0)  # waiting requests at which a pod counts as full
    kv_cache_threshold: float = Field(_DEFAULTS.kv_cache, gt=0,  # KV-cache use at which a pod counts as full
                                      validation_alias=AliasChoices("kvCacheThreshold", "kvThreshold",
                                                                    "kv_cache_threshold"))
    stale_threshold: Duration = Field(_DEFAULTS.stale, ge=0)  # past the pod's scrape cadence: counts as full
    saturation_limit: float = Field(_FLOW.saturation_limit, gt=0)  # pool saturated when the mean pod level reaches it
    objectives: dict[str, int] = Field(default_factory=dict)  # objective name -> priority
    default_priority: int = 0
    max_wait: Duration = Field(0.0, ge=0)  # seconds a standard request may wait for capacity (0: route at once)
    poll_interval: Duration = Field(0.02, gt=0)  # how often a waiting request re-checks saturation
    retry_after: str = _FLOW.retry_after  # Retry-After header value on a 429
    flow_control: FlowControlSection = Field(default_factory=FlowControlSection)
    _thresholds: SaturationThresholds = PrivateAttr(default=_DEFAULTS)

    def model_post_init(self, context: Any, /) -> None:
        self._thresholds = SaturationThresholds(self.queue_threshold, self.kv_cache_threshold, self.stale_threshold)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AdmissionConfig:
        """The section as YAML gives it; ConfigError naming the bad key (`admission.maxWait: ...`)."""
        return decode(cls, data, "admission")

    @property
    def thresholds(self) -> SaturationThresholds:
        return self._thresholds

    @field_validator("objectives", mode="before")
    @classmethod
    def _objectives(cls, value: Any) -> Any:
        """{name: priority} or a list of {name, priority} (InferenceObjective-like)."""
        if isinstance(value, list):
            out: dict[str, Any] = {}
            for i, item in enumerate(value):
                if not isinstance(item, Mapping) or "name" not in item or set(item) - {"name", "priority"}:
                    raise ValueError(f"item {i} must be {{name, priority}}")
                out[str(item["name"])] = item.get("priority", 0)
            return out
        return value

    @field_validator("retry_after", mode="before")
    @classmethod
    def _retry_after(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class Priorities:
    """Request priority from its objective: the config's `objectives` first, then what the cluster declares
    (InferenceObjective resources, through Kubernetes discovery), else `defaultPriority`."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        config = config if config is not None else AdmissionConfig()
        self.configured = dict(config.objectives)
        self.default = config.default_priority
        self.discovered: dict[str, int] = {}

    def set_discovered(self, priorities: dict[str, int]) -> None:
        self.discovered = dict(priorities)

    def of(self, request: InferenceRequest) -> int:
        objective = request.objective
        if not objective:
            return self.default
        return self.configured.get(objective, self.discovered.get(objective, self.default))


class AdmissionController:
    """Decides whether a request (its priority already resolved) is routed now, after a bounded wait, or shed."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config if config is not None else AdmissionConfig()

    def saturated(self, candidates: Sequence[Endpoint], now: float) -> bool:
        return pool_saturation(candidates, now, self.config.thresholds) >= self.config.saturation_limit

    def _shed(self, request: InferenceRequest, level: float) -> RequestError:
        return RequestError(
            429,
            "saturated",
            f"pool saturated ({level:.2f} >= {self.config.saturation_limit:g}); request priority "
            f"{request.priority} is sheddable",
            headers={"retry-after": self.config.retry_after},
        )

    def check(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> bool:
        """The decision without waiting: raises 429 for a shed request; returns whether the request should wait
        for capacity (a standard request in a saturated pool, when `maxWait` allows)."""
        level = pool_saturation(candidates, now, self.config.thresholds)
        saturated = bool(candidates) and level >= self.config.saturation_limit
        if saturated and request.priority < 0:
            raise self._shed(request, level)
        return saturated and request.priority == 0 and self.config.max_wait > 0

    async def wait_for_capacity(
        self,
        candidates_fn: Callable[[], Sequence[Endpoint]],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """Poll until saturation clears or `maxWait` passes; returns either way (the request is not lost)."""
        deadline = clock() + self.config.max_wait
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                return
            await sleep(min(self.config.poll_interval, remaining))
            if not self.saturated(candidates_fn(), clock()):
                return
