"""The director: parse → admit → locate candidates → schedule → account. It knows policy only through the
Scheduler and Admission interfaces, and nothing of ext_proc, so Explain and benchmarks reuse it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint
from picker.observability import PickerMetrics
from picker.requests import InferenceRequest, RequestError, estimated_tokens
from picker.scheduling.types import Scheduler, SchedulingResult


class Admission(Protocol):
    """Admission control: returns when the request may be routed, raises RequestError(429/503) otherwise."""

    async def admit(
        self, request: InferenceRequest, candidates_fn: Callable[[], Sequence[Endpoint]], clock: Callable[[], float]
    ) -> None: ...


@dataclass(slots=True)
class Decision:
    """A routed request: ranked endpoints, the header value Envoy gets, and what to undo when it ends."""

    request: InferenceRequest
    ranked: list[Endpoint]
    destination: str
    result: SchedulingResult | None
    tokens: int
    started_at: float
    released: bool = False

    @property
    def endpoint(self) -> Endpoint:
        return self.ranked[0]


def filter_subset(candidates: Sequence[Endpoint], subset: tuple[str, ...] | None) -> Sequence[Endpoint]:
    """Honour Envoy's subset hint: entries are "ip:port" or "ip"; None means the whole pool."""
    if subset is None:
        return candidates
    wanted = set(subset)
    return [e for e in candidates if e.address in wanted or e.ip in wanted]


class Director:
    def __init__(
        self,
        pool: EndpointPool,
        scheduler: Scheduler,
        *,
        admission: Admission | None = None,
        metrics: PickerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        fallbacks: int = 1,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self.fallbacks = max(1, fallbacks)
        pool.add_removal_listener(scheduler.on_endpoint_removed)
        if metrics is not None:
            pool.add_removal_listener(metrics.forget_pod)

    def candidates(self, request: InferenceRequest) -> Sequence[Endpoint]:
        """Ready endpoints the request may go to; RequestError 503 when there are none."""
        ready = self.pool.ready()
        candidates = filter_subset(ready, request.subset)
        if not candidates:
            if request.subset is not None and ready:
                raise RequestError(503, "no_endpoints", "no ready endpoint matches the subset hint "
                                   f"({', '.join(request.subset) or 'empty'})")
            raise RequestError(503, "no_endpoints", "no ready endpoints in the pool")
        return candidates

    def rank(self, request: InferenceRequest) -> SchedulingResult:
        """Schedule without side effects on the index or counters (used by Explain)."""
        candidates = self.candidates(request)
        if not request.has_body:
            # Header-only requests (GET /v1/models, ...) carry no prompt: least loaded healthy endpoint.
            ranked = sorted(candidates, key=lambda e: (e.in_flight, e.last_picked_at))
            return SchedulingResult(ranked=ranked, profile="header-only")
        result = self.scheduler.schedule(request, candidates, self.clock())
        if not result.ranked:
            raise RequestError(503, "no_endpoints", "every candidate endpoint was filtered out")
        return result

    async def route(self, request: InferenceRequest) -> Decision:
        """Admit, schedule and account for one request. Raises RequestError with the client's status."""
        labels = (request.model, request.target_model or request.model, str(request.priority))
        try:
            if self.admission is not None and request.has_body:
                await self.admission.admit(request, lambda: self.candidates(request), self.clock)
                labels = (request.model, request.target_model or request.model, str(request.priority))
            start = time.perf_counter()
            result = self.rank(request)
            if self.metrics is not None:
                self.metrics.scheduler_duration.observe(time.perf_counter() - start)
        except RequestError as err:
            if self.metrics is not None:
                self.metrics.requests.labels(*labels).inc()
                self.metrics.errors.labels(*labels, err.code).inc()
            raise
        now = self.clock()
        ranked = result.ranked[: self.fallbacks]
        chosen = ranked[0]
        if request.has_body:
            self.scheduler.on_picked(request, chosen, now)
        tokens = estimated_tokens(request)
        chosen.start_request(tokens, now)
        if self.metrics is not None:
            self.metrics.requests.labels(*labels).inc()
            if result.prefix_blocks:
                self.metrics.index_hit_ratio.observe(result.prefix_matched_blocks / result.prefix_blocks)
        destination = ",".join(e.address for e in ranked)
        return Decision(request, ranked, destination, result, tokens, now)

    def release(self, decision: Decision) -> None:
        """The request finished (response end or stream closed): undo its in-flight accounting once."""
        if decision.released:
            return
        decision.released = True
        decision.endpoint.finish_request(decision.tokens)
        if self.metrics is not None:
            request = decision.request
            self.metrics.duration.labels(
                request.model, request.target_model or request.model, str(request.priority)
            ).observe(self.clock() - decision.started_at)
