"""The director: parse → resolve → admit → locate candidates → schedule → account, as synchronous steps.

`begin` resolves a request and offers it to the admission gate (placed now, held, or refused), `place` schedules
it and accounts for it, `release` undoes that when it ends. `picker serve` (`route`) and the benchmark's fast mode
run literally these steps; each supplies only how a held request waits (`go` and a call to `expire` at the hold's
deadline: the event loop's future and timer, or simulated-time events). It knows policy only through the Gate,
PostScoring and Scheduler interfaces and nothing of ext_proc: the servicer hands it headers and a body (and, at
the end, the token usage it read); Explain calls `screen` and `rank`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from picker.core.media import DEFAULT_MEDIA, MultimodalConfig
from picker.core.requests import InferenceRequest, RequestError, build_request, estimated_tokens
from picker.endpoints.model_listing import MODELS_PATH
from picker.endpoints.model_serving import ModelServing
from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.state import Endpoint
from picker.prefix.tokens import PromptTokenizer
from picker.routing.admission import Gate, Hold, PostScoring, Priorities, SloShedding, Ungated
from picker.routing.decision import Decision
from picker.routing.lifecycle import RequestPlugin
from picker.scheduling.types import Scheduler, SchedulingResult

log = logging.getLogger(__name__)


async def through_gate(gate: Gate[Any], offer: Callable[[Callable[[], bool]], Hold | None],
                       clock: Callable[[], float]) -> None:
    """The event loop's way through an admission gate: `offer(go)` offers the request; returns once it may be
    placed (the caller then places it and calls `gate.placed`); raises its RequestError when it is refused, at once
    or at its hold's deadline. A cancelled wait (the client left) withdraws it."""
    release = _Release()
    hold = offer(release.go)
    if hold is None or not hold.queued:  # placed now, or let go by the offer itself
        return
    loop = asyncio.get_running_loop()
    let_go = release.future = loop.create_future()

    def expired() -> None:
        refusal = gate.expire(hold)
        if refusal is not None and not let_go.done():
            let_go.set_exception(refusal)

    timer = loop.call_later(max(0.0, hold.deadline - clock()), expired)
    try:
        await let_go
    except asyncio.CancelledError:
        gate.withdraw(hold)
        raise
    finally:
        timer.cancel()


class _Release:
    """A held request's `go`: resolves the future its route awaits (none yet: let go while being offered)."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None

    def go(self) -> bool:
        if self.future is None:
            return True
        if self.future.done():  # cancelled while held: withdrawn already
            return False
        self.future.set_result(None)
        return True


def match_subset(candidates: Sequence[Endpoint], subset: tuple[str, ...]) -> list[Endpoint]:
    """Endpoints named by Envoy's subset hint, by "ip:port" or by "ip"."""
    wanted = set(subset)
    return [e for e in candidates if e.destination in wanted or e.ip in wanted]


class Director:
    def __init__(
        self,
        pool: EndpointPool,
        scheduler: Scheduler,
        *,
        gate: Gate[Any] | None = None,
        plugins: Sequence[RequestPlugin] = (),
        priorities: Priorities | None = None,
        post_scoring: Sequence[PostScoring] = (SloShedding(),),
        models: ModelServing | None = None,
        tokenizer: PromptTokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        fallbacks: int = 1,
        media: MultimodalConfig = DEFAULT_MEDIA,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.gate: Gate[Any] = gate if gate is not None else Ungated()  # the bounded wait or flow control
        self.plugins = tuple(plugins)  # what acts on a request at the points of its life (picker/routing/lifecycle)
        # whether any of them acts when a response starts: the servicer then keeps Envoy sending response headers
        self.hears_response_start = any(p.hears_response_start for p in self.plugins)
        self.priorities = priorities if priorities is not None else Priorities()
        self.post_scoring = tuple(post_scoring)  # admission that reads the scores (SLO shedding)
        self.models = models if models is not None else ModelServing()  # which pods serve which model
        self.tokenizer = tokenizer  # precise prefix routing: the prompt's token ids before it is scheduled
        self.media = media  # what each model counts an image, audio or video part as
        self.clock = clock
        self.fallbacks = max(1, fallbacks)
        self.chars_per_token = scheduler.chars_per_token  # counts our requests' tokens as the plugins do
        pool.subscribe(self._pool_changed)

    def _pool_changed(self, event: PoolEvent, endpoint: Endpoint) -> None:
        """A departed pod is forgotten by the scheduler; so is the cache of an unready one, presumed lost, and of one
        seen to have restarted between two scrapes (vLLM restarts empty). (Its metrics series go when it leaves the
        pool: the server's concern.)"""
        if event is PoolEvent.REMOVED or event is PoolEvent.UNREADY or event is PoolEvent.RESTARTED:
            self.scheduler.on_endpoint_removed(endpoint)
        if event in (PoolEvent.ADDED, PoolEvent.READY, PoolEvent.DEGRADED):
            self.gate.kick()  # a pod joined or recovered (a degraded pod is routable): room

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

    def rank(self, request: InferenceRequest, now: float,
             candidates: Sequence[Endpoint] | None = None) -> SchedulingResult:
        """Schedule without side effects on the index or counters (used by Explain); RequestError when no pod
        remains or a post-scoring check refuses the request. `candidates`: `begin`'s, when nothing happened since."""
        found = candidates if candidates is not None else self.candidates(request)
        candidates = self.gate.with_room(found)
        if not request.has_body:
            # Header-only requests (GET /v1/models, ...) carry no prompt: least loaded healthy endpoint.
            ranked = sorted(candidates, key=lambda e: (e.in_flight, e.last_picked_at))
            return SchedulingResult(ranked=ranked, profile="header-only")
        result = self.scheduler.schedule(request, candidates, now)
        if not result.ranked:
            raise RequestError(503, "no_endpoints", "every candidate endpoint was filtered out")
        for check in self.post_scoring:
            check.check(request, result)
        return result

    def resolve(self, request: InferenceRequest) -> None:
        """What the request is before any pod is looked at: its priority, and the model the pod will get."""
        request.priority = self.priorities.of(request)
        for plugin in self.plugins:
            plugin.resolve(request)

    def begin(self, request: InferenceRequest, go: Callable[[], bool]) -> tuple[Hold | None, Sequence[Endpoint]]:
        """Step one: resolve the request and offer it to the gate with its candidates (returned too: `place` takes
        them when it runs at once). No hold: place it now; a hold: `go` is called when it may be placed, or
        `expire` refuses it at the hold's deadline. RequestError: refused now (429 shed, 503 no endpoint at all:
        not after a wait)."""
        self.resolve(request)
        candidates = self.candidates(request)
        return self.gate.offer(request, candidates, go), candidates

    def expire(self, hold: Hold) -> RequestError | None:
        """A hold's deadline has come: its refusal, or None (let go: its `go` has been called)."""
        return self.gate.expire(hold)

    def screen(self, request: InferenceRequest, now: float) -> dict[str, float]:
        """Explain's admission: resolve the request and raise the refusal the gate would give it at once, taking
        no place in a queue and no token budget; else what the gate weighs for it."""
        self.resolve(request)
        refusal = self.gate.refusal(request, self.candidates(request), now)
        if refusal is not None:
            raise refusal
        return self.gate.weighs(request)

    async def route(self, request: InferenceRequest, received: float = 0.0, body: bytes = b"") -> Decision:
        """Route a parsed request in real time: the steps, with the event loop's way to wait on a hold. Its
        duration and first token count from its arrival, time held included. `received`: when it was complete
        (perf_counter), for its decision's timing; `body`: the client's, as the plugins see it placed."""
        if self.tokenizer is None:
            request.parsed = None  # nothing will tokenize it: a waiting request does not keep its parsed body
        arrived = self.clock()
        at_once: list[Sequence[Endpoint]] = []  # begin's candidates, when nothing waits between it and place

        def offer(go: Callable[[], bool]) -> Hold | None:
            hold, candidates = self.begin(request, go)
            if (hold is None or not hold.queued) and self.tokenizer is None:  # tokenizing awaits a pod: not kept
                at_once.append(candidates)
            return hold

        await through_gate(self.gate, offer, self.clock)
        try:
            await self.tokenize(request)
        except BaseException:
            self.gate.placed()  # given up before it was placed: the next may go
            raise
        return self.place(request, self.clock(), arrived, at_once[0] if at_once else None, received, body)

    async def tokenize(self, request: InferenceRequest) -> None:
        """The prompt's token ids, for the precise view (bounded; none: the approximate index routes it); then
        the parsed body is let go, so a request in flight does not keep it. A prompt with media is not
        tokenized: the pods' blocks of a media item are keyed on an identifier of its processed content, which
        no token id says, so the precise view could match at most the text before it, while the approximate
        index keys the item by its content (and a pod asked to tokenize it would fetch and process the item)."""
        if self.tokenizer is not None and request.has_body and request.token_ids is None and not request.media:
            request.token_ids = await self.tokenizer.token_ids(request, lambda: self.candidates(request))
        request.parsed = None

    def place(self, request: InferenceRequest, now: float, arrived: float | None = None,
              candidates: Sequence[Endpoint] | None = None, received: float = 0.0,
              body: bytes = b"") -> Decision:
        """Step two: schedule an admitted request and account for it: the scheduler learns the pick, the pod's
        in-flight count moves at once (scraped metrics lag), the plugins see it placed, and the gate hears it is
        placed (or failed to be). `arrived`: when it came, if before `now`; `candidates`: `begin`'s, when it runs
        at once after it; `received`, `body`: as `route`'s."""
        began = time.perf_counter()
        try:
            result = self.rank(request, now, candidates)
            ranked = result.ranked[: self.fallbacks]
            chosen = ranked[0]
            if result.context is not None:
                self.scheduler.on_picked(result.context, chosen, now)
            tokens = estimated_tokens(request, self.chars_per_token)
            chosen.start_request(tokens, now)
            expected = (result.prefix_matched_blocks * result.context.block_chars // self.chars_per_token
                        if result.context is not None else 0)
            decision = Decision(request, ranked, ",".join(e.destination for e in ranked), result, tokens,
                                now if arrived is None else arrived, expected_cached=expected,
                                scheduled_s=time.perf_counter() - began,
                                decided_s=time.perf_counter() - received if received else 0.0)
            for plugin in self.plugins:
                plugin.placed(decision, body)
        finally:
            self.gate.placed()  # after the in-flight counts moved: the next is let through on the new level
        return decision

    async def route_http(self, headers: dict[str, str], body: bytes, *, request_id: str,
                         subset: tuple[str, ...] | None = None) -> Decision:
        """Parse, admit, schedule and account for one HTTP request; RequestError with the client's status."""
        received = time.perf_counter()
        request: InferenceRequest | None = None
        try:
            request = build_request(headers, body, request_id=request_id, subset=subset, media=self.media)
            decision = await self.route(request, received, body)
        except RequestError as err:
            self.refused(request or InferenceRequest(request_id=request_id, model="", path=headers.get(":path", "")),
                         err, time.perf_counter() - received)
            raise
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", describe_decision(decision, time.perf_counter() - received))
        return decision

    def refused(self, request: InferenceRequest, err: RequestError, took_s: float = 0.0) -> None:
        """A refusal, told to the plugins: the director's own, or the servicer's before any body was parsed (413,
        buffers full, a wrong method or path), when no model is known yet."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("refused %s model=%s: %d %s: %s", request.request_id, request.model or "-", err.status,
                      err.code, err.message)
        for plugin in self.plugins:
            plugin.refused(request, err, took_s)

    def response_started(self, decision: Decision, headers: Mapping[str, str] | None = None,
                         body_follows: bool = False) -> None:
        """The response's headers came (`headers`: when its body will be shown, `body_follows`)."""
        for plugin in self.plugins:
            plugin.response_started(decision, headers or {}, body_follows)

    def response_chunk(self, decision: Decision, chunk: bytes, end: bool) -> bytes:
        """A chunk of the response body through the plugins: it, or what replaces it."""
        began = time.perf_counter()
        for plugin in self.plugins:
            chunk = plugin.response_chunk(decision, chunk, end, began)
        return chunk

    def release(self, decision: Decision) -> None:
        """The request finished (response end or stream closed): undo its in-flight accounting once, and tell
        the plugins."""
        if decision.released:
            return
        decision.released = True
        decision.endpoint.finish_request(decision.tokens)
        for plugin in self.plugins:
            plugin.finished(decision)
        self.gate.kick()  # room freed


def describe_decision(decision: Decision, took_s: float) -> str:
    """One debug line per decision: the request, where it went, what the index matched, the best candidates'
    totals, the chosen one's scores (and predictions) and the runner-up's (why not the other pod: a prefix credit
    zeroed by the load guard shows there), and how long the decision took, waits included. A prompt no pod holds
    any of but whose opening has a home (the pod it goes back to once every pod evicted it) names it: `home=ADDRESS`."""
    request, result = decision.request, decision.result
    parts = [f"routed {request.request_id} model={request.model or '-'} priority={request.priority} "
             f"-> {decision.destination}"]
    if result is not None:
        ctx = result.context
        home = f" home={ctx.home}" if ctx is not None and ctx.home is not None and not ctx.matches else ""
        parts.append(f"profile={result.profile} prefix={result.prefix_matched_blocks}/{result.prefix_blocks} blocks"
                     f"{home}")
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
