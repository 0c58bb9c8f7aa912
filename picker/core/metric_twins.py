"""The reference picker's deprecated metric names, emitted beside the current `llm_d_epp_*` ones.

The reference (GIE's picker, now llm-d's router) writes every series it renamed twice, under the current name and
the deprecated one, so dashboards keep working through the rename. We record each observation once, under the
current name, and re-emit it under the deprecated name when /metrics is scraped: the twin costs nothing on the
request path. A twin keeps some of its source's labels (possibly renamed) and sums over the others (the
deprecated names carried fewer labels).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


@dataclass(frozen=True, slots=True)
class Twin:
    name: str  # the deprecated family name (a counter's without `_total`)
    source: Collector  # the series recorded under the current name (a metric, or a collector of several)
    labels: tuple[str, ...]  # the source's labels the twin keeps, in the twin's order
    renames: Mapping[str, str] = field(default_factory=dict)  # source label -> the twin's name for it
    family: str = ""  # of a collector of several families: the one this twin copies


class TwinCollector(Collector):
    """Every twin, computed from its source at scrape time."""

    def __init__(self, twins: Iterable[Twin]) -> None:
        self.twins = tuple(twins)

    def collect(self) -> Iterator[Metric]:
        for twin in self.twins:
            for family in twin.source.collect():
                if not twin.family or family.name == twin.family:
                    yield _rename(family, twin)


def _rename(family: Metric, twin: Twin) -> Metric:
    out = Metric(twin.name, f"{family.documentation} (deprecated name)", family.type)
    kept = set(twin.labels) | {"le"}
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        suffix = sample.name[len(family.name):]
        if suffix == "_created":  # a sum over series has no single creation time
            continue
        labels = tuple((twin.renames.get(k, k), v) for k, v in sample.labels.items() if k in kept)
        key = (suffix, labels)
        sums[key] = sums.get(key, 0.0) + sample.value
    out.samples = [Sample(twin.name + suffix, dict(labels), value) for (suffix, labels), value in sums.items()]
    return out
