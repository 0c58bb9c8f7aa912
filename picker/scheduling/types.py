"""The seam between the ext_proc layer and policy: a scheduler ranks endpoints for one request, with no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from picker.core.requests import InferenceRequest
from picker.endpoints.state import Endpoint
from picker.prefix.index import PrefixIndex
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import PeerPick


@dataclass(slots=True)
class CandidateScore:
    """One endpoint's scores, for the Explain API and traces: scorer name -> [0,1], and the weighted total."""

    endpoint: Endpoint
    scores: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    filtered_by: str | None = None  # name of the filter that removed it, if any
    details: dict[str, float] = field(default_factory=dict)  # "plugin.figure" -> value (e.g. predicted TTFT parts)


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """A P/D handler's decision for one request: the prefill pod (None: decode-only), for the header and the
    decision metric (labelled with the handler's name and type, as the reference's)."""

    plugin_name: str
    plugin_type: str
    prefill: Endpoint | None

    @property
    def decision_type(self) -> str:
        return "decode-only" if self.prefill is None else "prefill-decode"


@dataclass(slots=True)
class SchedulingResult:
    """Ranked endpoints (best first) plus the why: profile used and every candidate's scores."""

    ranked: list[Endpoint]
    profile: str = "default"
    candidates: list[CandidateScore] = field(default_factory=list)
    prefix_blocks: int = 0  # blocks in the request's prefix key chain
    prefix_matched_blocks: int = 0  # blocks the chosen endpoint already holds (index view)
    # The request's cycle state, handed back to `Scheduler.on_picked` (None for header-only requests: no prompt)
    context: SchedulingContext | None = None
    # With a P/D profile handler: where the prompt is prefilled (None without one: no decision to count)
    disaggregation: Disaggregation | None = None

    @property
    def prefill(self) -> Endpoint | None:
        return self.disaggregation.prefill if self.disaggregation is not None else None

    @property
    def weights(self) -> dict[str, float]:
        """Each scorer's weight in the profile that ranked the candidates (what `total` sums); Explain reads it."""
        return {}

    @property
    def profile_reason(self) -> str:
        """Why the profile handler chose `profile`, in a sentence; Explain reads it."""
        return ""


class Scheduler(Protocol):
    """Pure policy: ranks `endpoints` for `request` at time `now`. Must not block or do I/O.

    Per-request state never lives in the scheduler: `schedule` returns it in `SchedulingResult.context` and the
    director hands that back to `on_picked`, so Explain (which never picks) and interleaved requests cannot mix
    one request's prefix keys up with another's."""

    @property
    def index(self) -> PrefixIndex:
        """The prefix index the scheduler reads and records into (a baseline without a prefix scorer records
        nothing in it)."""
        ...

    @property
    def chars_per_token(self) -> int:
        """How many characters of a prompt count as a token where its token ids are not known (configured)."""
        ...

    @property
    def learned_chars_per_token(self) -> float | None:
        """Characters per token of the traffic as learned from the pods (None: nothing learned)."""
        ...

    @property
    def may_disaggregate(self) -> bool:
        """Whether a request may be prefilled on another pod than its own (P/D): its prefill pod's count ends when
        the response begins, so the ext_proc stream must hear the response headers."""
        ...

    def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint], now: float) -> SchedulingResult: ...

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        """Called once the pick is final (e.g. to record the prompt's prefix on that endpoint)."""
        ...

    def on_peer_picked(self, pick: PeerPick, now: float) -> None:
        """Another replica sharing our prefix index routed a request to `pick.address` (its stream tells us)."""
        ...

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        """Called when an endpoint leaves the pool (e.g. purge its prefix-index entries)."""
        ...
