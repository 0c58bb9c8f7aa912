"""A stream's deadline that moves on every message for the price of a float store.

`asyncio.timeout` re-creates its timer handle on every `reschedule` (cancel one, schedule another); a stream moves
its deadline on each message, three or more times per request. `MovingDeadline` arms one timer and lets the
deadline move later freely: when the timer fires before the deadline it is armed again for the deadline as it
stands then, so a stream pays one timer per idle period, not one per message (a deadline moved earlier than the
armed timer re-arms it at once). On expiry it cancels the task and turns that cancellation into `TimeoutError` at
the end of the `with` block, as `asyncio.timeout` does, leaving a cancellation from anyone else alone.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class MovingDeadline:
    """`with MovingDeadline(loop, at) as deadline:` inside a task; `deadline.move(t)` moves it (loop time)."""

    __slots__ = ("at", "_armed_at", "_loop", "_task", "_cancelling", "_timer", "_expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self.at = at
        self._armed_at = at
        self._loop = loop
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    def __enter__(self) -> MovingDeadline:
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("MovingDeadline must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._arm()
        return self

    def move(self, at: float) -> None:
        self.at = at
        if at < self._armed_at and self._timer is not None:
            self._timer.cancel()
            self._arm()

    def _arm(self) -> None:
        self._armed_at = self.at
        self._timer = self._loop.call_at(self.at, self._due)

    def _due(self) -> None:
        if self._loop.time() < self.at:  # moved later since the timer was armed: wait for where it is now
            self._arm()
            return
        self._timer = None
        self._expired = True
        assert self._task is not None
        self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._expired:
            assert self._task is not None
            # Ours was the cancellation (no other is pending): it becomes the timeout.
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
