"""Polling for tests whose subject converges asynchronously (replication, watches)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    """Wait until `check()` holds; fail the test if it does not within `within` seconds."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
