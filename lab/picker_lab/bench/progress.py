"""A progress bar on stderr: redrawn in place on a terminal, one line per 10 % otherwise (CI logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Counts work units (requests) towards `total`; `advance` is cheap to call often."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = self.stream.isatty()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def _line(self) -> str:
        frac = self.done / self.total
        filled = int(frac * self.width)
        elapsed = time.monotonic() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {frac:6.1%} {self.done}/{self.total} requests  {elapsed:5.0f}s elapsed, ~{eta:4.0f}s left  {self.label}"

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._tty:
            if force or now - self._last_draw > 0.2 or self.done >= self.total:
                self._last_draw = now
                self.stream.write("\r" + self._line()[:160].ljust(160))
                self.stream.flush()
            return
        decile = int(10 * self.done / self.total)
        if decile != self._last_decile or force:
            self._last_decile = decile
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._draw(force=True)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
