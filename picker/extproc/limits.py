"""What one ext_proc stream, and all of them together, may hold: the port is reachable by anyone who reaches the
pod, so neither buffered bodies nor open streams may grow without bound.

- A body is capped per stream (`--max-body-bytes`: 413) and in total over every stream still receiving one
  (`--max-buffered-bytes`: 503 `buffers_full` with retry-after), so slow or unfinished uploads cannot exhaust memory.
- A stream that sends nothing for `--stream-idle-timeout` before its decision is ended: headers with no body, a body
  that stops half-way.
- A routed request counts in flight (steering the next picks away from its pod) for at most `--request-timeout`
  (Envoy's route timeout, 600 s in our templates): a client that holds streams open cannot steer routing forever.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StreamLimits:
    max_body: int = 16 * 2**20
    max_buffered: int = 256 * 2**20
    idle_timeout: float = 30.0
    request_timeout: float = 600.0


class BodyBudget:
    """Request-body bytes held by all streams at once; `take` fails instead of exceeding the limit."""

    __slots__ = ("limit", "held")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held = max(0, self.held - size)
