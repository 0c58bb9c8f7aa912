"""Stopping background work: the same two steps every component with tasks or Redis clients ends with."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each to end, whatever it ends with (it is being stopped)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def close_clients(*clients: aioredis.Redis) -> None:
    """Close Redis clients; a server already gone is no error at shutdown."""
    for client in clients:
        with contextlib.suppress(RedisError, OSError):
            await client.aclose()
