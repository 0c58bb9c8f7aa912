"""Plugin contracts: filters narrow the candidates, scorers grade them in [0,1], pickers rank them.

Stateful plugins (session stickiness, cold spreading) learn from the final pick through `on_picked`, from the
picks of other replicas sharing the prefix index through `on_peer_picked`, and forget a departed endpoint through
`on_endpoint_removed`, like the prefix index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from picker.endpoints.state import Endpoint
from picker.requests import InferenceRequest
from picker.scheduling.context import SchedulingContext


@dataclass(frozen=True, slots=True)
class PeerPick:
    """What another picker replica routed, as the shared prefix index carries it."""

    address: str
    prompt_chars: int
    session_id: str = ""


class Plugin:
    """Base of every configured plugin: a name (for config refs and Explain) and no-op lifecycle hooks."""

    type_name = "plugin"
    needs_prefix = False  # True for plugins that read the prefix match (hashing is skipped when none does)

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.type_name

    def on_picked(self, request: InferenceRequest, endpoint: Endpoint, now: float) -> None:
        return None

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """Another replica picked `pick.address`: learn from it as from our own picks, so replicas do not herd."""
        return None

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        return None


@runtime_checkable
class Filter(Protocol):
    name: str

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        """Survivors of `candidates` (may raise RequestError when the request cannot be served at all)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        """One score in [0,1] per candidate, same order; higher is better."""
        ...


def min_max_inverse(values: Sequence[float]) -> list[float]:
    """GIE-style normalisation: the lowest value scores 1, the highest 0, all equal -> 1."""
    lo = min(values)
    hi = max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]
