"""Give the memory large request bodies passed through back to the system.

Every body chunk the picker receives is copied a few times on its way in (gRPC's receive buffers, the protobuf
message, the `bytes` we keep), mostly by gRPC's own threads. glibc keeps what they free in per-thread arenas and
returns it only from the top of each, so after a burst of large uploads the picker's RSS stays well above what it
ever held at once. `malloc_trim(0)` hands whole free pages back; it costs time in proportion to what it returns, so
it runs in a worker thread, once enough body bytes have passed since the last one, and never twice at once. On a C
library without `malloc_trim` (musl) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 8 * 2**20


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


class AllocatorTrim:
    """Counts body bytes that passed through; past `after_bytes` it schedules one trim off the event loop."""

    __slots__ = ("after_bytes", "passed", "running", "trims", "_trim")

    def __init__(self, trim: Callable[[int], int] | None, after_bytes: int = TRIM_AFTER_BYTES) -> None:
        self.after_bytes = after_bytes
        self.passed = 0
        self.running = False
        self.trims = 0
        self._trim = trim

    @classmethod
    def from_libc(cls, after_bytes: int = TRIM_AFTER_BYTES) -> AllocatorTrim:
        return cls(_glibc_malloc_trim(), after_bytes)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def body_bytes(self, size: int) -> None:
        """`size` bytes of request body were received (and their transient copies freed, or soon will be)."""
        if self._trim is None:
            return
        self.passed += size
        if self.passed >= self.after_bytes and not self.running:
            self.passed = 0
            self.running = True
            asyncio.get_running_loop().run_in_executor(None, self._run).add_done_callback(self._done)

    def _run(self) -> None:
        assert self._trim is not None
        self._trim(0)

    def _done(self, future: asyncio.Future[None]) -> None:
        self.running = False
        self.trims += 1
        if (err := future.exception()) is not None:
            log.warning("malloc_trim failed (%r); no more trims", err)
            self._trim = None
