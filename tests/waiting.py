"""Polling for tests whose subject converges asynchronously (replication, watches, a running picker)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], bool], within: float = 5.0, what: str = "condition") -> None:
    """Wait until `check()` holds; fail the test, naming `what`, if it does not within `within` seconds."""

    async def holds() -> bool:
        return check()

    await eventually_async(holds, what, within)


async def eventually_async(check: Callable[[], Awaitable[bool]], what: str, within: float = 5.0) -> None:
    """Await `check()` until it returns true (for conditions that need I/O to observe, such as a call to a
    running picker); fail naming `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within:g} s: {what}")
        await asyncio.sleep(0.01)
