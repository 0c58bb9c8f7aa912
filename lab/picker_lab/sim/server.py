"""HTTP surface of one simulated vLLM pod (aiohttp): OpenAI API, /metrics, /tokenize, render, health, info.

A `SimPod` owns an Engine, its real-time driver, its metrics registry and (optionally) a KV-event publisher. Every
response carries `x-sim-pod: <pod name>` and completions carry `system_fingerprint: "vllm-0.32.0-<pod name>"`, so
tests can tell which pod served a request; nothing else distinguishes the pod from vLLM except timing.

A pod never leaves a request hanging: bad bodies get vLLM's 400 (openai_api validates them), a request that
fails inside the engine gets a 500 (a JSON error event when streaming), any other exception in a handler is
logged once and answered with a 500 JSON error, and if the engine's stepping task ever died, waiting requests
would get a 500 and /health a 503 (as vLLM's does for a dead engine) instead of the pod looking ready while
nothing completes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from picker_lab.sim.dialects import MetricDialect, MetricsPage
from picker_lab.sim.driver import RealtimeDriver, RequestHandle
from picker_lab.sim.engine import ERROR, Engine, FinishedRequest, SimRequest, StepResult
from picker_lab.sim.info_routes import VLLM_VERSION, InfoRoutes
from picker_lab.sim.kv_events import DEFAULT_TOPIC, KVEventPublisher, pod_topic
from picker_lab.sim.metrics import SimMetrics
from picker_lab.sim.openai_api import (
    ApiError,
    GenerationPlan,
    ServedModel,
    internal_error,
    parse_chat,
    parse_completion,
)
from picker_lab.sim.profiles import Profile
from picker_lab.sim.responses import (
    SSE_DONE,
    ChoiceResult,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
    usage,
    usage_chunk,
)

log = logging.getLogger(__name__)

POD_HEADER = "x-sim-pod"


class PodBindError(OSError):
    """A pod's HTTP port cannot be bound (taken, no such host): `picker sim` says so in one line and exits 2."""

    def __init__(self, pod: str, host: str, port: int, reason: str, *, bad_host: bool = False) -> None:
        super().__init__(f"{pod}: {host}:{port}: {reason}")
        self.pod = pod
        self.host = host
        self.port = port
        self.reason = reason
        self.bad_host = bad_host  # the host did not resolve: no port would have done


@dataclass
class PodConfig:
    """Everything that makes one simulated vLLM instance."""

    name: str
    profile: Profile
    model: str | None = None  # served model name; default: the profile's model
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    time_scale: float = 1.0
    seed: int = 0
    lora_modules: dict[str, str] = field(default_factory=dict)
    kv_events_endpoint: str | None = None
    kv_events_topic: str | None = DEFAULT_TOPIC  # None: kv@<host>:<port>@<model>, told apart on a shared endpoint
    kv_events_replay: str | None = None  # where its replay socket binds (vLLM's replay_endpoint)
    kv_events_bind_port: int = 0  # or: its publisher binds tcp://<its host>:PORT (vLLM's tcp://*:PORT on a pod)
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = True
    prefix_caching_hash_algo: str = "sha256"
    process_metrics: bool = True
    engine: MetricDialect = "vllm"  # whose metric names (and pages) the pod serves; the rest stays vLLM's API
    rank: int = 0  # its engine's index (the `engine` label): a data-parallel server's rank (data_parallel.py)


class SimPod(InfoRoutes):
    """One simulated vLLM server. `await start()` binds the port; `await stop()` releases everything."""

    def __init__(self, config: PodConfig) -> None:
        self.config = config
        self.name = config.name
        self.model_name = config.model or config.profile.model
        self.engine = Engine(
            config.profile,
            seed=config.seed,
            lora_modules=config.lora_modules,
            record_kv_events=config.kv_events_endpoint is not None or config.kv_events_bind_port > 0,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.metrics = SimMetrics(
            self.engine,
            self.model_name,
            lora_enabled=bool(config.lora_modules),
            prefix_caching_hash_algo=config.prefix_caching_hash_algo,
            process_metrics=config.process_metrics,
            dialect=config.engine,
            engine_index=config.rank,
        )
        self.served = ServedModel(
            name=self.model_name,
            root=self.model_name,
            max_model_len=config.profile.max_model_len,
            tokenizer=self.engine.tokenizer,
            lora_modules=dict(config.lora_modules),
        )
        self.port = config.port
        self.started = time.time()
        # vLLM's looks like "vllm-0.32.0-c89a11e4"; ours names the pod so tests can tell who served a request
        self.fingerprint = f"vllm-{VLLM_VERSION}-{self.name}"
        self.driver: RealtimeDriver | None = None
        self.publisher: KVEventPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._closing = False
        self._engine_failure: BaseException | None = None  # why the driver's stepping task crashed, if it did
        self._waiting: set[asyncio.Event] = set()  # `changed` events of requests in flight (woken on a crash)
        self._logged: set[str] = set()  # keys of failures already logged (each is logged once)
        self._api_free_at = 0.0  # loop time until which /metrics rendering holds this pod's API server

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8001."""
        return f"http://{self.config.host}:{self.port}"

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start_engine(self) -> None:
        """Start stepping the engine in real time (what a rank of a data-parallel server runs without a port)."""
        self.driver = RealtimeDriver(self.engine, self.config.time_scale, self._on_step)
        self.driver.start()
        self._watch_driver(self.driver)

    async def start(self) -> None:
        """Start the engine driver, the KV-event publisher and the HTTP listener."""
        self.start_engine()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the engine request
        # (vLLM aborts requests of disconnected clients, streaming or not)
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:  # the caller's stop() releases the driver and runner started above
            bad_host = isinstance(exc, socket.gaierror)
            reason = exc.strerror if bad_host or not exc.errno else os.strerror(exc.errno)
            raise PodBindError(self.name, self.config.host, self.config.port, str(reason).lower(),
                               bad_host=bad_host) from None
        address = self._runner.addresses[0]
        self.port = int(address[1])
        self.open_publisher()  # after the bind: the topic may name the port

    def open_publisher(self, topic: str | None = None) -> None:
        """Publish the engine's KV events as configured (nothing when not), under `topic` (default: the config's,
        else one naming this pod's address); a data-parallel rank publishes on its server's endpoints offset by
        its rank."""
        c = self.config
        if c.kv_events_endpoint:
            topic = topic or c.kv_events_topic or pod_topic(c.host, self.port, self.model_name)
            self.publisher = KVEventPublisher(c.kv_events_endpoint, topic, c.kv_events_replay, dp_rank=c.rank)
        elif c.kv_events_bind_port:
            self.publisher = KVEventPublisher(f"tcp://{c.host}:{c.kv_events_bind_port}",
                                              topic or c.kv_events_topic or DEFAULT_TOPIC, c.kv_events_replay,
                                              bind=True, dp_rank=c.rank)

    async def stop(self) -> None:
        """Stop serving; pending requests get an error."""
        self._closing = True
        if self.driver is not None:
            try:
                await self.driver.stop()
            except Exception:
                if self._engine_failure is None:
                    raise  # else the crash was logged when it happened (_driver_done)
        for changed in self._waiting:
            changed.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _watch_driver(self, driver: RealtimeDriver) -> None:
        """Notice if the stepping task ever ends other than by stop(): log it and fail what waits on it."""
        driver.on_exit(self._driver_done)

    def _driver_done(self, task: asyncio.Task[None]) -> None:
        """The engine loop ended: if it crashed, /health turns 503 and waiting requests get a 500."""
        if task.cancelled() or task.exception() is None:
            return
        self._engine_failure = task.exception()
        log.error("%s: the engine loop died; failing requests in flight", self.name,
                  exc_info=self._engine_failure)  # fmt: skip
        for changed in self._waiting:
            changed.set()

    def _log_once(self, key: str, message: str) -> None:
        """Log the current exception with its traceback the first time `key` fails (hooks run every step)."""
        if key not in self._logged:
            self._logged.add(key)
            log.exception("%s: %s (logged once)", self.name, message)

    def _on_step(self, result: StepResult) -> None:
        """Metrics and KV events of one step; runs inside the driver's loop, so it must never raise."""
        try:
            self.metrics.observe_step(result)
        except Exception:
            self._log_once("metrics", "recording step metrics failed")
        if self.publisher is not None and result.kv_events:
            try:
                self.publisher.publish(result.kv_events)
            except Exception:
                self._log_once("kv-events", "publishing KV events failed")

    # --- app -------------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        """The aiohttp application with vLLM's routes."""
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        app.on_response_prepare.append(self._tag_response)
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_get("/version", self.version)
        for page in self.metric_pages():
            r.add_get(page.path, self.metrics_handler(page))
            if page.takes_names:
                r.add_get(page.path + "/", self.metrics_handler(page, names=True))
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/v1/completions/render", self.render_completion)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        return app

    def metric_pages(self) -> list[MetricsPage]:
        """The routes its metrics are served on (a data-parallel server: every rank's engine on one page)."""
        return self.metrics.pages()

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[POD_HEADER] = self.name

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM-shaped JSON for every error; an unexpected exception is a logged 500, never a dropped one."""
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ApiError as exc:
            return self._json(exc.body(), exc.status)
        except web.HTTPNotFound:
            return self._json({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return self._json({"detail": "Method Not Allowed"}, 405)
        except (web.HTTPException, ConnectionError):
            raise  # aiohttp's own answers (413, ...) and clients that went away
        except Exception:  # streams report their own failures (_stream): nothing has been sent here yet
            log.exception("%s: %s %s failed", self.name, request.method, request.path)
            return self._json(internal_error().body(), 500)

    # --- generation ------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        plan = parse_completion(await self._body(request), self.served)
        return await self._generate(request, plan, f"cmpl-{uuid.uuid4().hex[:16]}")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        plan = parse_chat(await self._body(request), self.served)
        return await self._generate(request, plan, f"chatcmpl-{uuid.uuid4().hex[:16]}")

    def _check_engine(self) -> None:
        """500 rather than waiting forever on an engine whose loop has died."""
        if self._engine_failure is not None:
            raise internal_error()

    async def _generate(self, request: web.Request, plan: GenerationPlan, rid: str) -> web.StreamResponse:
        await self._api_turn()  # request intake runs on the API server's loop
        if self._closing or self.driver is None:
            raise ApiError("The server is shutting down.", 503)
        self._check_engine()
        created = int(time.time())
        changed = asyncio.Event()
        handles: list[RequestHandle] = []
        prompt_of: list[int] = []
        self._waiting.add(changed)
        try:
            for p_idx, prompt in enumerate(plan.prompts):
                for _choice in range(plan.n):
                    req = SimRequest(
                        request_id=f"{rid}-{len(handles)}",
                        prompt_token_ids=prompt,
                        max_tokens=plan.max_tokens[p_idx],
                        lora_name=plan.lora_name,
                        cache_salt=plan.cache_salt,
                        ignore_eos=plan.ignore_eos,
                        min_tokens=plan.min_tokens,
                        remote_prefill=plan.remote_prefill,
                    )
                    try:
                        handles.append(self.driver.submit(req, changed, plan.stream))
                    except ValueError as exc:
                        raise ApiError(str(exc), 400) from None
                    prompt_of.append(p_idx)
            if plan.stream:
                return await self._stream(request, plan, rid, created, handles, prompt_of, changed)
            while not all(h.finished is not None for h in handles):
                if self._closing:
                    raise ApiError("The server is shutting down.", 503)
                self._check_engine()
                changed.clear()
                await changed.wait()
            finished = [h.finished for h in handles if h.finished is not None]
            if any(f.finish_reason == ERROR for f in finished):
                raise internal_error()  # as vLLM's GenerationError; the engine logged the cause
            choices = [ChoiceResult(i, self.engine.decode(f.output_token_ids), f.finish_reason)
                       for i, f in enumerate(finished)]  # fmt: skip
            use = self._usage(plan, finished)
            build = completion_response if plan.kind == "completion" else chat_response
            return self._json(build(rid, created, plan.model, choices, use, self.fingerprint,
                                    self._kept_for_decode(plan, rid)))
        finally:
            self._waiting.discard(changed)
            self._abort_unfinished(handles)

    def _kept_for_decode(self, plan: GenerationPlan, rid: str) -> dict[str, Any] | None:
        """A prefill asked to keep its KV for a remote decode (NIXL's handshake) answers with where to fetch it;
        the sim's decode side only needs to know it was prefilled elsewhere (its prompt blocks are loaded)."""
        if not plan.remote_decode:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.name,
                "remote_block_ids": [], "remote_host": self.config.host, "remote_port": self.port,
                "remote_request_id": rid, "tp_size": 1}

    def _usage(self, plan: GenerationPlan, finished: list[FinishedRequest]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in plan.prompts)
        completion_tokens = sum(len(f.output_token_ids) for f in finished)
        cached = finished[0].num_cached_tokens if finished else 0
        if not self.config.enable_prompt_tokens_details:
            return usage(prompt_tokens, completion_tokens, None)
        return usage(prompt_tokens, completion_tokens, cached, 0 if plan.kind == "chat" else None)

    def _abort_unfinished(self, handles: list[RequestHandle]) -> None:
        if self.driver is None:
            return
        for h in handles:
            if h.finished is None:
                fin = self.driver.abort(h.request_id)
                if fin is not None:
                    self.metrics.observe_finished(fin)

    async def _stream(
        self,
        request: web.Request,
        plan: GenerationPlan,
        rid: str,
        created: int,
        handles: list[RequestHandle],
        prompt_of: list[int],
        changed: asyncio.Event,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            await self._stream_events(response, plan, rid, created, handles, prompt_of, changed)
        except ConnectionError:
            raise  # the client went away
        except Exception:  # the 200 is out: the error can only go in the stream, as vLLM sends it
            log.exception("%s: streaming %s failed", self.name, rid)
            await self._end_stream_with_error(response, [])
        return response

    async def _stream_events(
        self,
        response: web.StreamResponse,
        plan: GenerationPlan,
        rid: str,
        created: int,
        handles: list[RequestHandle],
        prompt_of: list[int],
        changed: asyncio.Event,
    ) -> None:
        """Write the SSE chunks of every handle as tokens arrive, then usage and [DONE]."""
        chat = plan.kind == "chat"
        sent = [0] * len(handles)
        done = [False] * len(handles)
        model = plan.model
        decode = self.engine.decode
        while not all(done):
            out: list[bytes] = []
            for i, h in enumerate(handles):
                if done[i]:
                    continue
                new = h.tokens[sent[i] :]
                fin = h.finished
                if not new and fin is None:
                    continue
                if fin is not None and fin.finish_reason == ERROR:
                    return await self._end_stream_with_error(response, out)  # the engine logged the cause
                if chat and sent[i] == 0 and new:
                    role_use = usage(len(plan.prompts[prompt_of[i]]), 0, None) if plan.continuous_usage else None
                    out.append(sse(chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}, None,
                                              _no_details(role_use))))  # fmt: skip
                sent[i] = len(h.tokens)
                reason = fin.finish_reason if fin is not None else None
                use = None
                if plan.continuous_usage:
                    use = _no_details(usage(len(plan.prompts[prompt_of[i]]), sent[i], None))
                fingerprint = self.fingerprint if reason is not None and not plan.include_usage else None
                text = decode(new)
                if chat:
                    out.append(sse(chat_chunk(rid, created, model, i, {"content": text}, reason, use, fingerprint)))
                else:
                    out.append(sse(completion_chunk(rid, created, model, i, text, reason, use, fingerprint)))
                if fin is not None:
                    done[i] = True
            if out:
                await self._api_turn()  # so does every streamed chunk
                await response.write(b"".join(out))
            if not all(done):
                if self._closing:
                    break
                if self._engine_failure is not None:
                    return await self._end_stream_with_error(response, [])
                changed.clear()
                await changed.wait()
        finished = [h.finished for h in handles if h.finished is not None]
        if plan.include_usage and all(done):
            use = self._usage(plan, finished)
            await response.write(sse(usage_chunk(rid, created, model, plan.kind, use, self.fingerprint)))
        await response.write(SSE_DONE)
        await response.write_eof()

    @staticmethod
    async def _end_stream_with_error(response: web.StreamResponse, pending: list[bytes]) -> None:
        """What vLLM streams when generation fails after the 200 went out: an error event, then [DONE]."""
        await response.write(b"".join(pending) + sse(internal_error().body()) + SSE_DONE)
        await response.write_eof()

    # --- other endpoints -------------------------------------------------------------------------------------
def _no_details(use: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per-chunk (continuous) usage has only the three counts (vLLM sets just those fields)."""
    if use is None:
        return None
    return {k: use[k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
