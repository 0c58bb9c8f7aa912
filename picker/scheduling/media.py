"""Media affinity: send a request whose images (audio, video) a pod has already encoded to that pod, wherever in the
prompt they stand. The prefix scorers already keep equal media at equal positions after equal text together (a
media part is part of the prefix keys, picker.core.media); a model server's encoder cache also spares it encoding
an image again in another context (another question, another conversation). The reference picker's
`mm-embeddings-cache-producer` and `-scorer` do this pair's job; they are accepted as this scorer.

Each pod's media are remembered as they are sent there (the most recent `entriesPerPod`, the reference's 2 MiB an
image over its `cacheSizeInMBPerServer`); a pod scores the share of the request's distinct media it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import Plugin, PluginDeps, PluginFactory, default_of

REFERENCE_TYPE = "mm-embeddings-cache-scorer"
REFERENCE_PRODUCER = "mm-embeddings-cache-producer"
MIB_PER_ITEM = 2  # the reference's estimate of one encoded image's size


def digests(ctx: SchedulingContext) -> set[str]:
    return {item.digest for item in ctx.request.media}


class MediaAffinityScorer(Plugin):
    type_name = "media-affinity-scorer"

    def __init__(self, name: str | None = None, *, entries_per_pod: int = 2048) -> None:
        super().__init__(name)
        self.entries_per_pod = entries_per_pod
        self._held: dict[str, OrderedDict[str, None]] = {}

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        wanted = digests(ctx)
        if not wanted:
            return [0.0] * len(candidates)
        out = []
        for e in candidates:
            held = self._held.get(e.address)
            out.append(sum(d in held for d in wanted) / len(wanted) if held else 0.0)
        return out

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        wanted = digests(ctx)
        if not wanted:
            return
        held = self._held.setdefault(endpoint.address, OrderedDict())
        for digest in wanted:
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > self.entries_per_pod:
            held.popitem(last=False)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._held.pop(endpoint.address, None)


class MediaAffinityParams(Section):
    entries_per_pod: int = Field(default_of(MediaAffinityScorer, "entries_per_pod"), gt=0)


class ReferenceScorerParams(MediaAffinityParams):
    producer_name: str = ""  # the reference's: which producer feeds it (here the scorer is its own)


def _media_affinity(name: str, p: MediaAffinityParams, deps: PluginDeps) -> Plugin:
    return MediaAffinityScorer(name, entries_per_pod=p.entries_per_pod)


class ReferenceProducerParams(Section):
    """`mm-embeddings-cache-producer`'s parameter, moved onto the scorer (picker.scheduling.reference)."""

    cache_size_in_mb_per_server: int = Field(4096, alias="cacheSizeInMBPerServer")

    def entries_per_pod(self) -> int:
        return max(1, (self.cache_size_in_mb_per_server if self.cache_size_in_mb_per_server > 0 else 4096)
                   // MIB_PER_ITEM)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(MediaAffinityScorer.type_name, MediaAffinityParams, _media_affinity),
    PluginFactory(REFERENCE_TYPE, ReferenceScorerParams, _media_affinity),
)
