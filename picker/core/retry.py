"""Exponential backoff with jitter: the one retry delay every reconnecting loop in the picker uses.

Delays grow by `multiplier` from `initial` up to `cap`, and are jittered so that replicas that lost the same
server at the same moment do not come back in lockstep. "full" jitter draws each delay uniformly from
[0, ceiling]; "decorrelated" draws from [initial, 3 x the previous delay] (capped), which spreads retries as
well and never waits almost nothing twice in a row; "none" is plain doubling. `reset()` after a success starts
the next failure streak at `initial` again. The random source and the sleep are injectable so tests can check
the delays without waiting for them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Literal

Jitter = Literal["full", "decorrelated", "none"]


class Backoff:
    """One loop's delays: `await wait()` after a failure, `reset()` after a success."""

    def __init__(self, initial: float, cap: float, *, multiplier: float = 2.0, jitter: Jitter = "full",
                 rand: Callable[[], float] = random.random,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        if not 0 < initial <= cap:
            raise ValueError(f"backoff needs 0 < initial <= cap, got {initial} and {cap}")
        if multiplier < 1:
            raise ValueError(f"backoff multiplier {multiplier} < 1 would shrink the delays")
        self.initial = initial
        self.cap = cap
        self.multiplier = multiplier
        self.jitter: Jitter = jitter
        self._rand = rand
        self._sleep = sleep
        self.failures = 0  # since the last reset
        self._ceiling = initial  # the un-jittered delay of the next failure
        self._previous = initial  # the last delay handed out (decorrelated jitter grows from it)

    def next_delay(self) -> float:
        """The delay for one more failure (advances the streak; no sleeping)."""
        self.failures += 1
        if self.jitter == "decorrelated":
            high = min(self.cap, max(self.initial, self._previous * 3))
            delay = self.initial + self._rand() * (high - self.initial)
        elif self.jitter == "full":
            delay = self._rand() * self._ceiling
        else:
            delay = self._ceiling
        self._ceiling = min(self.cap, self._ceiling * self.multiplier)
        self._previous = delay
        return delay

    async def wait(self, at_least: float = 0.0) -> float:
        """Sleep the next delay (no less than `at_least`, e.g. a server's Retry-After); returns the delay."""
        delay = max(self.next_delay(), at_least)
        await self._sleep(delay)
        return delay

    async def sleep(self, delay: float) -> None:
        """Sleep `delay` with the injected sleep (for callers that log the `next_delay()` before waiting)."""
        await self._sleep(delay)

    def reset(self) -> None:
        """A success: the next failure waits about `initial` again."""
        self.failures = 0
        self._ceiling = self.initial
        self._previous = self.initial
