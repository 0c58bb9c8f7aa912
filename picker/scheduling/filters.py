"""Filters: remove candidates that should not get the request. (The subset hint Envoy sends is applied by
the director before scheduling: a pod outside it is never a candidate.)"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.saturation import SaturationThresholds, not_past_full
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import Plugin, PluginDeps, PluginFactory


class SaturationFilter(Plugin):
    """Drop pods past full (picker.endpoints.saturation: the level admission control reads too) — unless that would
    drop every pod.

    Routing to a saturated pod only adds to its queue; when all are saturated, admission control (not this
    filter) decides who waits or is shed. A pod whose metrics are stale is at "full", not past it: kept.
    """

    type_name = "saturation-filter"

    def __init__(self, name: str | None = None, *, thresholds: SaturationThresholds | None = None) -> None:
        super().__init__(name)
        self.thresholds = thresholds if thresholds is not None else SaturationThresholds()

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        kept = not_past_full(candidates, ctx.now, self.thresholds)
        return kept if kept else candidates


class SaturationFilterParams(Section):
    """Unset thresholds are the admission section's (one definition of a full pod)."""

    queue_threshold: float | None = Field(None, gt=0)
    kv_cache_threshold: float | None = Field(None, gt=0)


def _saturation(name: str, p: SaturationFilterParams, deps: PluginDeps) -> Plugin:
    base = deps.saturation
    thresholds = SaturationThresholds(p.queue_threshold if p.queue_threshold is not None else base.queue,
                                      p.kv_cache_threshold if p.kv_cache_threshold is not None else base.kv_cache,
                                      base.stale)
    return SaturationFilter(name, thresholds=thresholds)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(SaturationFilter.type_name, SaturationFilterParams, _saturation),
)
