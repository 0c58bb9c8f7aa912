"""A routed request, as the director hands it back and its life-cycle plugins see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from picker.core.requests import InferenceRequest
from picker.endpoints.state import Endpoint
from picker.scheduling.types import SchedulingResult


@dataclass(slots=True)
class Decision:
    """A routed request: ranked endpoints, the header value Envoy gets, what the pod's request gets besides (set by
    life-cycle plugins, serialised by the protocol in front), and what to undo when it ends."""

    request: InferenceRequest
    ranked: list[Endpoint]
    destination: str
    result: SchedulingResult | None
    tokens: int
    started_at: float  # when the request came (its duration and TTFT are measured from here)
    released: bool = False
    expected_cached: int = 0  # prompt tokens the index expected the pod to have cached
    scheduled_s: float = 0.0  # the picker's time scheduling and accounting for it
    decided_s: float = 0.0  # the picker's time from a complete request to this decision, waits included
    body: bytes | None = None  # the body the pod gets, when it is not the client's
    # What the pod's request gets beyond the destination: headers set, and the client's headers removed (only
    # those it carries: a locked-down gateway refuses the removal of an absent header as any other mutation).
    set_headers: dict[str, str] | None = None
    removed_headers: tuple[str, ...] = ()
    # Per-request state of the life-cycle plugins, by plugin name (created by the first that keeps some)
    state: dict[str, Any] | None = None

    @property
    def endpoint(self) -> Endpoint:
        return self.ranked[0]

    @property
    def prefill(self) -> Endpoint | None:
        """With P/D: the pod the scheduler chose to prefill it."""
        return self.result.prefill if self.result is not None else None

    def set_header(self, name: str, value: str) -> None:
        self.set_headers = {**(self.set_headers or {}), name: value}

    def remove_header(self, name: str) -> None:
        if name not in self.removed_headers:
            self.removed_headers = (*self.removed_headers, name)

    def own_header(self, name: str, value: str | None) -> None:
        """A header only the picker may give the pod: set to `value`, or, with None, the client's removed (a
        removal Envoy refuses for a header the request lacks, so only when it carries one)."""
        if value is not None:
            self.set_header(name, value)
        elif name in self.request.headers:
            self.remove_header(name)

    def keep(self, plugin: str, value: Any) -> None:
        """A plugin's state for this request (`kept(plugin)` gives it back)."""
        if self.state is None:
            self.state = {}
        self.state[plugin] = value

    def kept(self, plugin: str) -> Any:
        return None if self.state is None else self.state.get(plugin)
