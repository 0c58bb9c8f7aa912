"""Admission control: the `Gate` interface the director's steps run, GIE's saturation detector as one gate
(`BoundedWait`; flow control, picker.flowcontrol, is the other), SLO shedding after scoring; priorities from
objectives.

Shedding protects latency for important traffic: when the pool is saturated, sheddable requests
(priority < 0) get 429 + Retry-After at once; standard ones (priority 0) may wait up to `maxWait` for
capacity and then go through anyway (never lost); critical ones (priority > 0) never wait. The director
resolves each request's priority (`Priorities`) before admission reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import AliasChoices, Field, PrivateAttr, field_validator

from picker.core.headers import RETRY_AFTER
from picker.core.requests import InferenceRequest, RequestError
from picker.core.schema import Duration, Section, decode
from picker.endpoints.saturation import SaturationThresholds, pool_saturation
from picker.endpoints.state import Endpoint
from picker.flowcontrol.controller import FlowSettings
from picker.flowcontrol.queues import Fairness

if TYPE_CHECKING:
    from picker.scheduling.types import SchedulingResult

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
    fairness: Fairness = _FLOW.fairness  # between a band's flows: one turn each, or the least tokens served first
    output_token_weight: float = Field(_FLOW.output_token_weight, ge=0)  # token fairness: an output token's cost


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


class Hold(Protocol):
    """A request a gate holds: when the gate must hear of it again (`Gate.expire`), and whether it still waits."""

    @property
    def deadline(self) -> float: ...

    @property
    def queued(self) -> bool: ...


H = TypeVar("H", bound=Hold)


class Gate(Protocol[H]):
    """Admission: whether a request (its priority resolved) is placed now, waits, or is refused. The director runs
    the same synchronous steps in `picker serve` and in the benchmark's simulated time; each supplies only how a
    held request waits: the `go` it hands to `offer`, and a call to `expire` at the hold's deadline."""

    def offer(self, request: InferenceRequest, candidates: Sequence[Endpoint], go: Callable[[], bool]) -> H | None:
        """None: place the request now. A hold: `go` is called when it may be placed (False back: its client
        has left), possibly before `offer` returns (then the hold is no longer `queued`). RequestError: refused
        at once. Either way the caller calls `placed` once the request is placed or given up."""
        ...

    def expire(self, hold: H) -> RequestError | None:
        """The hold's deadline has come: its refusal, or None (it was let go, now or before)."""
        ...

    def withdraw(self, hold: H) -> None:
        """The held request's client has left."""
        ...

    def placed(self) -> None:
        """A request let through is placed on a pod (or given up): the next may go."""
        ...

    def kick(self) -> None:
        """Room may have freed (a request finished, a pod joined): let held requests go."""
        ...

    def pod_refreshed(self, endpoint: Endpoint) -> None:
        """A pod's metrics were refreshed."""
        ...

    def load_synced(self, peers: int) -> None:
        """The pods' in-flight counts now include `peers` other replicas' (picker.endpoints.shared_load): room may
        have freed, and until the next sync each of them may let through about as many requests as we do."""
        ...

    def with_room(self, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Where a request let through may go."""
        ...

    def refusal(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> RequestError | None:
        """The refusal `offer` would give at once, without taking a place or a budget (Explain)."""
        ...

    def weighs(self, request: InferenceRequest) -> dict[str, float]:
        """What admission weighs for `request` beside its priority, by name (Explain): flow control's token cost
        and its flow's count under fairness by tokens; nothing for the other gates."""
        ...


class PostScoring(Protocol):
    """Admission that needs the scores: raises RequestError to refuse a request once it is scheduled."""

    def check(self, request: InferenceRequest, result: SchedulingResult) -> None: ...


class SloShedding:
    """A sheddable request with a TTFT objective (x-slo-ttft-ms) that no pod is predicted to meet is shed: the
    prediction scorer says so in the request's cycle state (`slo_attainable`)."""

    def check(self, request: InferenceRequest, result: SchedulingResult) -> None:
        slo = request.slo_ttft_s
        if slo is not None and request.priority < 0 and result.context is not None \
                and result.context.slo_attainable is False:
            raise RequestError(429, "slo_unattainable", f"no pod is predicted to give the first token within "
                               f"{slo * 1e3:g} ms (x-slo-ttft-ms); the request is sheddable",
                               headers={RETRY_AFTER: "1"})


class Ungated:
    """No admission: every request is placed at once (the baselines without a picker's admission)."""

    def offer(self, request: InferenceRequest, candidates: Sequence[Endpoint], go: Callable[[], bool]) -> None:
        return None

    def expire(self, hold: Hold) -> None:
        return None

    def withdraw(self, hold: Hold) -> None:
        return None

    def placed(self) -> None:
        return None

    def kick(self) -> None:
        return None

    def pod_refreshed(self, endpoint: Endpoint) -> None:
        return None

    def load_synced(self, peers: int) -> None:
        return None

    def with_room(self, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return candidates

    def weighs(self, request: InferenceRequest) -> dict[str, float]:
        return {}

    def refusal(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> None:
        return None


@dataclass(slots=True, eq=False)
class _Waiting:
    """A standard request held until its candidates' saturation clears or `maxWait` passes."""

    candidates: Sequence[Endpoint]
    go: Callable[[], bool]
    deadline: float
    queued: bool = True


class BoundedWait:
    """GIE's saturation detector as a gate: in a saturated pool a sheddable request is refused (429) at once, a
    standard one waits up to `maxWait` for room and then goes anyway (never lost), a critical one goes at once.
    Saturation reads scraped metrics only, so a held request is re-checked when a pod is refreshed or joins."""

    def __init__(self, config: AdmissionConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config if config is not None else AdmissionConfig()
        self.clock = clock
        self.waiting: list[_Waiting] = []

    def saturated(self, candidates: Sequence[Endpoint], now: float) -> bool:
        return pool_saturation(candidates, now, self.config.thresholds) >= self.config.saturation_limit

    def weighs(self, request: InferenceRequest) -> dict[str, float]:
        return {}

    def refusal(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> RequestError | None:
        if request.priority >= 0 or not request.has_body or not candidates:
            return None
        level = pool_saturation(candidates, now, self.config.thresholds)
        if level < self.config.saturation_limit:
            return None
        return RequestError(429, "saturated", f"pool saturated ({level:.2f} >= {self.config.saturation_limit:g}); "
                            f"request priority {request.priority} is sheddable",
                            headers={RETRY_AFTER: self.config.retry_after})

    def offer(self, request: InferenceRequest, candidates: Sequence[Endpoint],
              go: Callable[[], bool]) -> _Waiting | None:
        if not request.has_body:
            return None
        now = self.clock()
        refused = self.refusal(request, candidates, now)
        if refused is not None:
            raise refused
        if request.priority != 0 or self.config.max_wait <= 0 or not candidates or not self.saturated(candidates, now):
            return None
        held = _Waiting(candidates, go, now + self.config.max_wait)
        self.waiting.append(held)
        return held

    def _take(self, held: _Waiting) -> bool:
        """Take a held request out of the wait; False when it is out already."""
        if not held.queued:
            return False
        held.queued = False
        self.waiting.remove(held)
        return True

    def expire(self, hold: _Waiting) -> RequestError | None:
        """Never a refusal: a request that waited its maxWait goes anyway."""
        if self._take(hold):
            hold.go()
        return None

    def withdraw(self, hold: _Waiting) -> None:
        self._take(hold)

    def placed(self) -> None:
        return None

    def kick(self) -> None:
        if not self.waiting:
            return
        now = self.clock()
        for held in [h for h in self.waiting if not self.saturated(h.candidates, now)]:
            if self._take(held):
                held.go()

    def pod_refreshed(self, endpoint: Endpoint) -> None:
        self.kick()

    def load_synced(self, peers: int) -> None:
        self.kick()

    def with_room(self, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
        return candidates
