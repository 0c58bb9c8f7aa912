"""The director: parse → resolve priority → admit → locate candidates → schedule → account.

It knows policy only through the Scheduler and Admission interfaces and nothing of ext_proc: the servicer hands
it headers and a body (and, at the end, the token usage it read), Explain and the benchmark's fast mode call
`rank` and `decide` directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from picker.admission import Priorities
from picker.endpoints.model_listing import MODELS_PATH
from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.state import Endpoint
from picker.flowcontrol.controller import FlowController
from picker.model_rewrite import ModelRewrites, body_for_target, response_swaps
from picker.model_serving import ModelServing
from picker.observability import DecisionTracer, PickerMetrics, ResponseTrace
from picker.prefix.hashing import CHARS_PER_TOKEN
from picker.prefix.tokens import PromptTokenizer
from picker.requests import InferenceRequest, RequestError, Usage, build_request, estimated_tokens
from picker.scheduling.types import Scheduler, SchedulingResult

log = logging.getLogger(__name__)


class Admission(Protocol):
    """Admission control on a request whose priority is resolved: shed (RequestError 429), or tell whether it
    should wait for capacity first."""

    def check(self, request: InferenceRequest, candidates: Sequence[Endpoint], now: float) -> bool:
        """Raises RequestError(429) to shed; returns True when the request should wait for capacity."""
        ...

    def wait_for_capacity(self, candidates_fn: Callable[[], Sequence[Endpoint]],
                          clock: Callable[[], float]) -> Awaitable[None]:
        """Returns once capacity frees or the configured wait is over (never raises for a standard request)."""
        ...


def match_subset(candidates: Sequence[Endpoint], subset: tuple[str, ...]) -> list[Endpoint]:
    """Endpoints named by Envoy's subset hint, by "ip:port" or by "ip"."""
    wanted = set(subset)
    return [e for e in candidates if e.address in wanted or e.ip in wanted]


@dataclass(slots=True)
class Decision:
    """A routed request: ranked endpoints, the header value Envoy gets, and what to undo when it ends."""

    request: InferenceRequest
    ranked: list[Endpoint]
    destination: str
    result: SchedulingResult | None
    tokens: int
    started_at: float  # when the request came (its duration and TTFT are measured from here)
    released: bool = False
    expected_cached: int = 0  # prompt tokens the index expected the pod to have cached
    body: bytes | None = None  # the body the pod gets, when it is not the client's (its model rewritten)
    swaps: tuple[tuple[bytes, bytes], ...] = ()  # in response bodies: the pod's model name -> the client's

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
        priorities: Priorities | None = None,
        metrics: PickerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        fallbacks: int = 1,
        tracer: DecisionTracer | None = None,
        chars_per_token: int = CHARS_PER_TOKEN,
        flow: FlowController | None = None,
        models: ModelServing | None = None,
        rewrites: ModelRewrites | None = None,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.admission = admission
        self.priorities = priorities if priorities is not None else Priorities()
        self.metrics = metrics
        self.clock = clock
        self.fallbacks = max(1, fallbacks)
        self.tracer = tracer
        self.chars_per_token = chars_per_token  # the scheduling config's prefixCache.charsPerToken
        self.flow = flow  # flow control: queues what the pool has no room for (replaces the bounded wait)
        self.models = models if models is not None else ModelServing()  # which pods serve which model
        self.rewrites = rewrites if rewrites is not None else ModelRewrites()  # requested model -> served one
        self.tokenizer = tokenizer  # precise prefix routing: the prompt's token ids before it is scheduled
        pool.subscribe(self._pool_changed)

    def _pool_changed(self, event: PoolEvent, endpoint: Endpoint) -> None:
        """A departed pod is forgotten everywhere; an unready one's cache is presumed lost (vLLM restarts empty),
        so the scheduler forgets what it holds but its metrics series stay until it leaves the pool."""
        if event is PoolEvent.REMOVED or event is PoolEvent.UNREADY:
            self.scheduler.on_endpoint_removed(endpoint)
        if event is PoolEvent.REMOVED and self.metrics is not None:
            self.metrics.forget_pod(endpoint)
        if self.flow is not None and event in (PoolEvent.ADDED, PoolEvent.READY, PoolEvent.DEGRADED):
            self.flow.kick()  # a pod joined or recovered (a degraded pod is routable): room

    def candidates(self, request: InferenceRequest) -> Sequence[Endpoint]:
        """Ready endpoints the request may go to (Envoy's subset hint applied); RequestError 503 when none."""
        ready = self.pool.ready()
        candidates = ready if request.subset is None else match_subset(ready, request.subset)
        if not candidates:
            if request.subset is not None and ready:
                raise RequestError(503, "no_endpoints", "no ready endpoint matches the subset hint "
                                   f"({', '.join(request.subset) or 'empty'})")
            raise RequestError(503, "no_endpoints", "no ready endpoints in the pool")
        model = request.target_model or request.model
        if request.has_body and model:
            return self.models.pods_for(model, candidates)
        return candidates

    def answer_locally(self, headers: dict[str, str]) -> bytes | None:
        """The body the picker answers a header-only request with itself, or None to route it: `GET /v1/models`
        lists the ready pool's models (a pod would list only its own) once its pods report them."""
        if headers.get(":method", "GET").upper() != "GET" or headers.get(":path", "").split("?", 1)[0] != MODELS_PATH:
            return None
        return self.models.listing(self.pool.ready())

    def rank(self, request: InferenceRequest, now: float) -> SchedulingResult:
        """Schedule without side effects on the index or counters (used by Explain)."""
        candidates = self.candidates(request)
        if self.flow is not None:
            candidates = self.flow.with_room(candidates)
        if not request.has_body:
            # Header-only requests (GET /v1/models, ...) carry no prompt: least loaded healthy endpoint.
            ranked = sorted(candidates, key=lambda e: (e.in_flight, e.last_picked_at))
            return SchedulingResult(ranked=ranked, profile="header-only")
        result = self.scheduler.schedule(request, candidates, now)
        if not result.ranked:
            raise RequestError(503, "no_endpoints", "every candidate endpoint was filtered out")
        slo = request.slo_ttft_s
        if slo is not None and request.priority < 0 and result.context is not None \
                and result.context.slo_attainable is False:  # priority resolved by admit() before
            raise RequestError(429, "slo_unattainable", f"no pod is predicted to give the first token within "
                               f"{slo * 1e3:g} ms (x-slo-ttft-ms); the request is sheddable",
                               headers={"retry-after": "1"})
        return result

    def resolve(self, request: InferenceRequest) -> None:
        """What the request is before any pod is looked at: its priority, and the model the pod will get."""
        request.priority = self.priorities.of(request)
        if self.rewrites:
            self.rewrites.apply(request)

    def admit(self, request: InferenceRequest, now: float) -> bool:
        """Resolve the request and run admission without waiting: raises RequestError (429 shed, 503 no
        endpoint); returns whether the request should wait for capacity before it is placed."""
        self.resolve(request)
        if self.admission is None or not request.has_body:
            return False
        return self.admission.check(request, self.candidates(request), now)

    def decide(self, request: InferenceRequest, now: float) -> Decision:
        """The whole decision, synchronously, at time `now`: admit (a request that would wait goes at once),
        schedule, record the pick. Simulated time (the benchmark's fast mode) calls this directly."""
        self.admit(request, now)
        return self.place(request, now)

    async def route(self, request: InferenceRequest) -> Decision:
        """Route a parsed request in real time: with flow control it waits its turn while the pool has no room;
        without, a standard request in a saturated pool first waits (bounded)."""
        if self.tokenizer is None:
            request.parsed = None  # nothing will tokenize it: a waiting request does not keep its parsed body
        if self.flow is not None:
            arrived = self.clock()
            self.resolve(request)
            self.candidates(request)  # no endpoint at all: 503 now, not after a wait
            await self.flow.admit(request)
            try:
                await self._tokenize(request)
                decision = self.place(request, self.clock())
            finally:
                self.flow.placed()
            decision.started_at = arrived  # its duration and first token count the time it queued
            return decision
        if self.admit(request, self.clock()) and self.admission is not None:
            await self.admission.wait_for_capacity(lambda: self.candidates(request), self.clock)
        await self._tokenize(request)
        return self.place(request, self.clock())

    async def _tokenize(self, request: InferenceRequest) -> None:
        """The prompt's token ids, for the precise view (bounded; none: the approximate index routes it); then
        the parsed body is let go, so a request in flight does not keep it."""
        if self.tokenizer is not None and request.has_body and request.token_ids is None:
            request.token_ids = await self.tokenizer.token_ids(request, lambda: self.candidates(request))
        request.parsed = None

    def place(self, request: InferenceRequest, now: float) -> Decision:
        """Schedule an admitted request and account for it: the scheduler learns the pick, the pod's in-flight
        count moves at once (scraped metrics lag)."""
        start = time.perf_counter()
        result = self.rank(request, now)
        ranked = result.ranked[: self.fallbacks]
        chosen = ranked[0]
        if result.context is not None:
            self.scheduler.on_picked(result.context, chosen, now)
        tokens = estimated_tokens(request, self.chars_per_token)
        chosen.start_request(tokens, now)
        if self.metrics is not None:
            self.metrics.observe_routed(request, time.perf_counter() - start, result.prefix_matched_blocks,
                                        result.prefix_blocks, chosen,
                                        result.context.block_chars if result.context is not None else 0)
        destination = ",".join(e.address for e in ranked)
        expected = (result.prefix_matched_blocks * result.context.block_chars // self.chars_per_token
                    if result.context is not None else 0)
        return Decision(request, ranked, destination, result, tokens, now, expected_cached=expected)

    async def route_http(self, headers: dict[str, str], body: bytes, *, request_id: str,
                         subset: tuple[str, ...] | None = None) -> Decision:
        """Parse, admit, schedule and account for one HTTP request; RequestError with the client's status."""
        start_ns = time.time_ns() if self.tracer is not None else 0
        began = time.perf_counter()
        request: InferenceRequest | None = None
        try:
            request = build_request(headers, body, request_id=request_id, subset=subset)
            decision = await self.route(request)
        except RequestError as err:
            self.refused(request or InferenceRequest(request_id=request_id, model="", path=headers.get(":path", "")),
                         err, start_ns)
            raise
        target = request.target_model
        if target is not None and target != request.model and request.has_body:
            decision.body = body_for_target(body, target)
            decision.swaps = response_swaps(target, request.model)
        if self.metrics is not None:
            self.metrics.observe_processing(time.perf_counter() - began)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", describe_decision(decision, time.perf_counter() - began))
        if self.tracer is not None:
            result = decision.result
            self.tracer.record(start_ns, time.time_ns(), {
                **self._span_attributes(request), "picker.destination": decision.destination,
                "picker.profile": result.profile if result else "",
                "picker.prefix_blocks": result.prefix_blocks if result else 0,
                "picker.prefix_matched_blocks": result.prefix_matched_blocks if result else 0})
        return decision

    def refused(self, request: InferenceRequest, err: RequestError, start_ns: int = 0) -> None:
        """Count (and trace) a refusal: the director's own, or the servicer's before any body was parsed (413,
        buffers full, a wrong method or path), when no model is known yet."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("refused %s model=%s: %d %s: %s", request.request_id, request.model or "-", err.status,
                      err.code, err.message)
        if self.metrics is not None:
            self.metrics.observe_refused(request, err.code, scheduling=err.code == "no_endpoints")
        if self.tracer is not None:
            self.tracer.record(start_ns or time.time_ns(), time.time_ns(), {
                **self._span_attributes(request), "picker.error.status": err.status, "picker.error.code": err.code})

    @staticmethod
    def _span_attributes(request: InferenceRequest) -> dict[str, str | int | float]:
        return {"picker.request_id": request.request_id, "gen_ai.request.model": request.model,
                "picker.priority": request.priority, "http.route": request.path.split("?", 1)[0]}

    def trace_response(self, decision: Decision) -> ResponseTrace:
        """What the stream records of a response whose body Envoy shows the picker (its chunks' timing)."""
        itl = self.metrics.itl_observer(decision.request) if self.metrics is not None else None
        return ResponseTrace(decision.started_at, itl)

    def release(self, decision: Decision, usage: Usage | None = None, response: ResponseTrace | None = None) -> None:
        """The request finished (response end or stream closed): undo its in-flight accounting once, and
        record the token usage the model server reported and how the response came, when its body was visible."""
        if decision.released:
            return
        decision.released = True
        decision.endpoint.finish_request(decision.tokens)
        if self.flow is not None:
            self.flow.kick()  # room freed
        if self.metrics is not None:
            self.metrics.observe_finished(decision.request, self.clock() - decision.started_at, usage, response)
            if usage is not None and usage.prompt_tokens:
                self.metrics.observe_prefix_hit(decision.endpoint, min(decision.expected_cached, usage.prompt_tokens),
                                                usage.cached_tokens)


def describe_decision(decision: Decision, took_s: float) -> str:
    """One debug line per decision: the request, where it went, what the index matched, the best candidates'
    totals, the chosen one's scores (and predictions) and the runner-up's (why not the other pod: a prefix credit
    zeroed by the load guard shows there), and how long the decision took, waits included."""
    request, result = decision.request, decision.result
    parts = [f"routed {request.request_id} model={request.model or '-'} priority={request.priority} "
             f"-> {decision.destination}"]
    if result is not None:
        parts.append(f"profile={result.profile} prefix={result.prefix_matched_blocks}/{result.prefix_blocks} blocks")
        scored = sorted(result.candidates, key=lambda c: c.total, reverse=True)[:3]
        if scored:
            parts.append("top " + " ".join(f"{c.endpoint.address}={c.total:.2f}(in-flight {c.endpoint.in_flight} "
                                           f"waiting {c.endpoint.metrics.waiting:g})" for c in scored))
        chosen = next((c for c in result.candidates if c.endpoint is decision.endpoint), None)
        if chosen is not None:
            parts.append("scores " + " ".join(f"{k}={v:.2f}" for k, v in chosen.scores.items()))
            if chosen.details:
                parts.append(" ".join(f"{k}={v:.3g}" for k, v in chosen.details.items()))
        runner_up = next((c for c in scored if c is not chosen), None)
        if runner_up is not None:
            parts.append(f"runner-up {runner_up.endpoint.address} " + " ".join(f"{k}={v:.2f}" for k, v in
                                                                             runner_up.scores.items()))
    parts.append(f"in {took_s * 1e3:.1f} ms")
    return "; ".join(parts)
