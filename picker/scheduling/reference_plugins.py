"""Plugins the reference picker (GIE's, now llm-d's router) ships that ours had no twin for, with its meanings, so
its EndpointPickerConfig files run unchanged: the scorers `running-requests-size-scorer`, `load-aware-scorer`,
`active-request-scorer` and `no-hit-lru-scorer` and the `single-profile-handler` (its
`weighted-random-picker` stands with our pickers, in `picker.py`). Each is written from the reference's documented behaviour, in our plugin contracts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import (
    NoParams,
    Plugin,
    PluginDeps,
    PluginFactory,
    default_of,
    min_max_inverse,
    no_params,
)


class RunningRequestsSizeScorer(Plugin):
    """Fewest running requests (vllm:num_requests_running), min-max normalised across candidates."""

    type_name = "running-requests-size-scorer"

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        return min_max_inverse([e.metrics.running for e in candidates])


class LoadAwareScorer(Plugin):
    """0.5 for an empty waiting queue, falling linearly to 0 at `threshold` waiting requests: a queue scorer
    whose scale is absolute, not relative to the other candidates."""

    type_name = "load-aware-scorer"

    def __init__(self, name: str | None = None, *, threshold: int = 128) -> None:
        super().__init__(name)
        self.threshold = float(threshold)

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        t = self.threshold
        return [0.5 * (1.0 - min(e.metrics.waiting, t) / t) for e in candidates]


class ActiveRequestScorer(Plugin):
    """Requests this picker has in flight on each candidate: at most `idle_threshold` scores 1, busier ones
    (max - count) / max scaled into [0, max_busy_score]. Moves at once, unlike scraped metrics."""

    type_name = "active-request-scorer"

    def __init__(self, name: str | None = None, *, idle_threshold: int = 0, max_busy_score: float = 1.0) -> None:
        super().__init__(name)
        self.idle_threshold = idle_threshold
        self.max_busy_score = max_busy_score

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        counts = [e.in_flight for e in candidates]
        most = max(counts)
        idle, busy = self.idle_threshold, self.max_busy_score
        return [1.0 if c <= idle else (most - c) / most * busy for c in counts]


class NoHitLRUScorer(Plugin):
    """For a request no candidate holds any prefix of (a cold prefill), prefer the pods that took a cold prefill
    least recently, never-used ones first, so cold prompts spread instead of piling onto one pod; every candidate
    scores 0.5 (neutral) for a warm request. Learns from this replica's picks."""

    type_name = "no-hit-lru-scorer"
    needs_prefix = True

    def __init__(self, name: str | None = None, *, lru_size: int = 1024) -> None:
        super().__init__(name)
        self.lru_size = lru_size
        self._cold_picks: OrderedDict[str, None] = OrderedDict()  # address, least recent cold pick first

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        n = len(candidates)
        if any(ctx.matched):
            return [0.5] * n
        if n == 1:
            return [1.0]
        order = {address: i for i, address in enumerate(self._cold_picks)}
        never = [i for i, e in enumerate(candidates) if e.address not in order]
        out = [0.0] * n
        for rank, i in enumerate(never):
            out[i] = 1.0 - rank / (n - 1)
        for i, e in enumerate(candidates):
            position = order.get(e.address)
            if position is not None:
                out[i] = max(0.0, 1.0 - (len(never) + position) / (n - 1))
        return out

    def _cold_pick(self, address: str) -> None:
        self._cold_picks.pop(address, None)
        self._cold_picks[address] = None
        if len(self._cold_picks) > self.lru_size:
            self._cold_picks.popitem(last=False)

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        if not ctx.matches:
            self._cold_pick(endpoint.address)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._cold_picks.pop(endpoint.address, None)


class SingleProfileHandler(Plugin):
    """The reference's profile handler for a config of one profile: every request runs it. Naming it is what
    `build_scheduler` does anyway without a request classifier; with more than one profile it is an error."""

    type_name = "single-profile-handler"


class LoadAwareParams(Section):
    threshold: int = Field(default_of(LoadAwareScorer, "threshold"), gt=0)


class ActiveRequestParams(Section):
    idle_threshold: int = Field(default_of(ActiveRequestScorer, "idle_threshold"), ge=0)
    max_busy_score: float = Field(default_of(ActiveRequestScorer, "max_busy_score"), ge=0, le=1)


class NoHitLRUParams(Section):
    lru_size: int = Field(default_of(NoHitLRUScorer, "lru_size"), gt=0)


def _load_aware(name: str, p: LoadAwareParams, deps: PluginDeps) -> Plugin:
    return LoadAwareScorer(name, threshold=p.threshold)


def _active(name: str, p: ActiveRequestParams, deps: PluginDeps) -> Plugin:
    return ActiveRequestScorer(name, idle_threshold=p.idle_threshold, max_busy_score=p.max_busy_score)


def _no_hit_lru(name: str, p: NoHitLRUParams, deps: PluginDeps) -> Plugin:
    return NoHitLRUScorer(name, lru_size=p.lru_size)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(RunningRequestsSizeScorer.type_name, NoParams, no_params(RunningRequestsSizeScorer)),
    PluginFactory(LoadAwareScorer.type_name, LoadAwareParams, _load_aware),
    PluginFactory(ActiveRequestScorer.type_name, ActiveRequestParams, _active),
    PluginFactory(NoHitLRUScorer.type_name, NoHitLRUParams, _no_hit_lru),
    PluginFactory(SingleProfileHandler.type_name, NoParams, no_params(SingleProfileHandler)),
)
