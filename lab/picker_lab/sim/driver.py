"""Real-time driver: runs an Engine on the asyncio loop and hands its outputs to waiting HTTP handlers.

Model time = (loop time - start) x time_scale. Each step is computed when it starts and its outputs are delivered
after sleeping `duration / time_scale`, so clients see vLLM-like timing scaled by `time_scale`.
Event-loop jitter must not stretch model time (a busy GPU runs its steps back to back), so while the engine is
busy the next step starts where the previous one ended, as long as that is at most `max_lag_s` of wall time
behind the clock; the driver then skips sleeps to catch up. Beyond that lag (the process is CPU-bound), steps start
at the current clock, i.e. late, as on an overloaded server. Requests are stamped with the clock when they arrive
and the engine does not admit them before that model time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from picker_lab.sim.engine import Engine, FinishedRequest, SimRequest, StepResult


class RequestHandle:
    """Tokens of one engine request as they come out; `changed` is set whenever something new arrived."""

    __slots__ = ("request_id", "tokens", "finished", "changed", "stream")

    def __init__(self, request_id: str, changed: asyncio.Event, stream: bool = True) -> None:
        self.request_id = request_id
        self.tokens: list[int] = []
        self.finished: FinishedRequest | None = None
        self.changed = changed
        self.stream = stream  # False: wake the waiter only when the request finishes (saves CPU per token)


class RealtimeDriver:
    """Owns the stepping task of one engine."""

    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        on_step: Callable[[StepResult], None] | None = None,
        max_lag_s: float = 0.05,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = engine
        self.time_scale = time_scale
        self.on_step = on_step
        self.max_lag = max_lag_s * time_scale  # in model seconds
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._wall0 = self._loop.time()

    def model_now(self) -> float:
        """Current model time in seconds since the driver started."""
        return (self._loop.time() - self._wall0) * self.time_scale

    def start(self) -> None:
        """Start the stepping task."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine-driver")

    def on_exit(self, callback: Callable[[asyncio.Task[None]], None]) -> None:
        """Call `callback` with the stepping task when it ends (stopped, or crashed: the server then fails what
        waits on it instead of letting it hang)."""
        if self._task is not None:
            self._task.add_done_callback(callback)

    async def stop(self) -> None:
        """Stop stepping and release every waiting handler."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in self._handles.values():
            handle.changed.set()

    def submit(self, req: SimRequest, changed: asyncio.Event | None = None, stream: bool = True) -> RequestHandle:
        """Add a request now; several handles may share one `changed` event (n > 1, prompt lists)."""
        handle = RequestHandle(req.request_id, changed or asyncio.Event(), stream)
        self.engine.add_request(req, self.model_now())
        self._handles[req.request_id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> FinishedRequest | None:
        """Drop a request whose client went away; returns its record (None if it already finished)."""
        handle = self._handles.pop(request_id, None)
        fin = self.engine.abort_request(request_id, self.model_now())
        if handle is not None:
            handle.finished = fin
            handle.changed.set()
        return fin

    async def _run(self) -> None:
        loop = self._loop
        engine = self.engine
        while True:
            nxt = engine.next_step_time()
            if nxt is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = max(self.model_now() - self.max_lag, nxt)
            result = engine.step(now)
            delay = self._wall0 + result.end / self.time_scale - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        handles = self._handles
        touched: set[RequestHandle] = set()
        for rid, token in result.new_tokens:
            handle = handles.get(rid)
            if handle is not None:
                handle.tokens.append(token)
                if handle.stream:
                    touched.add(handle)
        for fin in result.finished:
            handle = handles.pop(fin.request_id, None)
            if handle is not None:
                handle.finished = fin
                touched.add(handle)
        if self.on_step is not None:
            self.on_step(result)
        for handle in touched:
            handle.changed.set()
