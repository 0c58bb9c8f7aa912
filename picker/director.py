"""The director: parse → admit → locate candidates → schedule → account. It knows policy only through the
Scheduler and Admission interfaces, and nothing of ext_proc, so Explain and benchmarks reuse it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint
from picker.extproc.usage import Usage
from picker.observability import DecisionTracer, PickerMetrics
from picker.requests import InferenceRequest, RequestError, build_request, estimated_tokens
from picker.scheduling.filters import match_subset
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
        tracer: DecisionTracer | None = None,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self.fallbacks = max(1, fallbacks)
        self.tracer = tracer
        pool.add_removal_listener(scheduler.on_endpoint_removed)
        if metrics is not None:
            pool.add_removal_listener(metrics.forget_pod)

    def candidates(self, request: InferenceRequest) -> Sequence[Endpoint]:
        """Ready endpoints the request may go to; RequestError 503 when there are none."""
        ready = self.pool.ready()
        candidates = ready if request.subset is None else match_subset(ready, request.subset)
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

    async def route_http(self, headers: dict[str, str], body: bytes, *, request_id: str,
                         subset: tuple[str, ...] | None = None) -> Decision:
        """Parse, admit, schedule and account for one HTTP request; RequestError with the client's status."""
        start_ns = time.time_ns() if self.tracer is not None else 0
        request: InferenceRequest | None = None
        try:
            request = build_request(headers, body, request_id=request_id, subset=subset)
            decision = await self._route(request)
        except RequestError as err:
            if request is None:  # refused while parsing: no model known
                request = InferenceRequest(request_id=request_id, model="", path=headers.get(":path", ""))
            if self.metrics is not None:
                labels = (request.model, request.target_model or request.model, str(request.priority))
                self.metrics.requests.labels(*labels).inc()
                self.metrics.errors.labels(*labels, err.code).inc()
            if self.tracer is not None:
                self.tracer.record(start_ns, time.time_ns(), {**self._span_attributes(request),
                                                              "picker.error.status": err.status,
                                                              "picker.error.code": err.code})
            raise
        if self.tracer is not None:
            result = decision.result
            self.tracer.record(start_ns, time.time_ns(), {
                **self._span_attributes(request), "picker.destination": decision.destination,
                "picker.profile": result.profile if result else "",
                "picker.prefix_blocks": result.prefix_blocks if result else 0,
                "picker.prefix_matched_blocks": result.prefix_matched_blocks if result else 0})
        return decision

    @staticmethod
    def _span_attributes(request: InferenceRequest) -> dict[str, str | int | float]:
        return {"picker.request_id": request.request_id, "gen_ai.request.model": request.model,
                "picker.priority": request.priority, "http.route": request.path.split("?", 1)[0]}

    async def route(self, request: InferenceRequest) -> Decision:
        """Route an already parsed request (benchmarks, tests)."""
        return await self._route(request)

    async def _route(self, request: InferenceRequest) -> Decision:
        if self.admission is not None and request.has_body:
            await self.admission.admit(request, lambda: self.candidates(request), self.clock)
        start = time.perf_counter()
        result = self.rank(request)
        now = self.clock()
        ranked = result.ranked[: self.fallbacks]
        chosen = ranked[0]
        if request.has_body:
            self.scheduler.on_picked(request, chosen, now)
        tokens = estimated_tokens(request)
        chosen.start_request(tokens, now)
        if self.metrics is not None:
            self.metrics.scheduler_duration.observe(time.perf_counter() - start)
            self.metrics.requests.labels(request.model, request.target_model or request.model,
                                         str(request.priority)).inc()
            if result.prefix_blocks:
                self.metrics.index_hit_ratio.observe(result.prefix_matched_blocks / result.prefix_blocks)
        destination = ",".join(e.address for e in ranked)
        return Decision(request, ranked, destination, result, tokens, now)

    def release(self, decision: Decision, usage: Usage | None = None) -> None:
        """The request finished (response end or stream closed): undo its in-flight accounting once, and
        record the token usage the model server reported, when the response body was visible."""
        if decision.released:
            return
        decision.released = True
        decision.endpoint.finish_request(decision.tokens)
        if self.metrics is not None:
            request = decision.request
            target = request.target_model or request.model
            self.metrics.duration.labels(request.model, target, str(request.priority)).observe(
                self.clock() - decision.started_at)
            if usage is not None:
                self.metrics.observe_usage(request.model, target, usage.prompt_tokens, usage.completion_tokens,
                                           usage.cached_tokens)
