"""Log lines an outsider can trigger, capped so that no one fills the log by sending garbage.

The ext_proc port may be reachable by anyone on the network; each malformed stream is counted in a metric, but
only the first few per window reach the log, and the next line that gets through says how many were held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class QuietLog:
    """At most `burst` lines per `window` seconds; the rest are counted and reported with the next line let out."""

    __slots__ = ("logger", "burst", "window", "clock", "_window_start", "_sent", "_held")

    def __init__(self, logger: logging.Logger, *, burst: int = 5, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.burst = burst
        self.window = window
        self.clock = clock
        self._window_start = -window
        self._sent = 0
        self._held = 0

    def log(self, level: int, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log unless this window's lines are spent; True when the line went out."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        if now - self._window_start >= self.window:
            self._window_start, self._sent = now, 0
        if self._sent >= self.burst:
            self._held += 1
            return False
        self._sent += 1
        if self._held:
            message += " (%d similar lines held back)"
            args = (*args, self._held)
            self._held = 0
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True
