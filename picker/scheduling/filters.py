"""Filters: remove candidates that must not (subset hint) or should not (saturated) get the request."""

from __future__ import annotations

from collections.abc import Sequence

from picker.endpoints.state import Endpoint
from picker.requests import RequestError
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import Plugin


def match_subset(candidates: Sequence[Endpoint], subset: tuple[str, ...] | None) -> list[Endpoint]:
    """Endpoints named by Envoy's subset hint, by "ip:port" or by "ip"; None means no hint (all of them)."""
    if subset is None:
        return list(candidates)
    wanted = set(subset)
    return [e for e in candidates if e.address in wanted or e.ip in wanted]


class SubsetFilter(Plugin):
    """Envoy's subset hint (request.subset): keep endpoints named by "ip:port" or by "ip"; none left -> 503."""

    type_name = "subset-filter"

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        subset = ctx.request.subset
        if subset is None:
            return candidates
        kept = match_subset(candidates, subset)
        if not kept:
            raise RequestError(
                503, "no_endpoints", f"no candidate endpoint matches the subset hint ({', '.join(subset) or 'empty'})"
            )
        return kept


class SaturationFilter(Plugin):
    """Drop pods whose queue or KV cache is past the threshold — unless that would drop every pod.

    Routing to a saturated pod only adds to its queue; when all are saturated, admission control (not this
    filter) decides who waits or is shed.
    """

    type_name = "saturation-filter"

    def __init__(
        self, name: str | None = None, *, queue_threshold: float = 5, kv_cache_threshold: float = 0.8
    ) -> None:
        super().__init__(name)
        self.queue_threshold = queue_threshold
        self.kv_cache_threshold = kv_cache_threshold

    def filter(self, ctx: SchedulingContext, candidates: list[Endpoint]) -> list[Endpoint]:
        q = self.queue_threshold
        kv = self.kv_cache_threshold
        kept = [e for e in candidates if e.metrics.waiting <= q and e.metrics.kv_usage <= kv]
        return kept if kept else candidates
