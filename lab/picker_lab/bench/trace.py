"""The trace format every benchmark mode replays: requests with send times, prompts and follow-up links.

A trace is data only, so fast mode, live mode and the oracle read exactly the same requests. Multi-turn
conversations cannot be written down in full ahead of time (each turn contains the previous answer), so a
follow-up names its `parent` and is completed with the parent's answer when it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. `at` is its open-loop send time (seconds); for a follow-up, the think time after the
    parent's answer arrived. Chat requests carry `messages` (their own new ones); completions carry `prompt`."""

    index: int
    at: float
    max_tokens: int
    group: int = -1  # shared-prefix group id (hot-prefix: 0 is the hot prefix); -1 when not grouped
    messages: tuple[Message, ...] = ()
    prompt: tuple[str, ...] | None = None  # completions: the prompt as parts (shared context, then suffix)
    parent: int = -1  # multi-turn: full messages = parent's messages + parent's answer + these messages
    session: str | None = None
    objective: str | None = None  # x-gateway-inference-objective (its priority comes from the picker's config)
    tenant: str | None = None  # x-llm-d-inference-fairness-id (flow control's flow)

    @property
    def is_chat(self) -> bool:
        return self.prompt is None


@dataclass(frozen=True, slots=True)
class Trace:
    """A named, seeded, reproducible list of requests in index order (parents before their follow-ups)."""

    workload: str
    seed: int
    rate: float  # requests/s the open-loop arrivals aim at (follow-ups included)
    requests: tuple[TraceRequest, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def children(self) -> dict[int, list[int]]:
        """parent index -> follow-up indices."""
        out: dict[int, list[int]] = {}
        for r in self.requests:
            if r.parent >= 0:
                out.setdefault(r.parent, []).append(r.index)
        return out
