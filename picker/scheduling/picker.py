"""Pickers turn weighted totals into a ranked list: best first, then fallbacks for Envoy to retry."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from picker.core.schema import Section
from picker.scheduling.plugins import Plugin, PluginDeps, PluginFactory, default_of


class _RankingPicker(Plugin):
    """What every picker holds: how many endpoints to rank (the best, then fallbacks) and its tie-break RNG."""

    def __init__(self, name: str | None = None, *, max_endpoints: int = 3, rng: random.Random | None = None) -> None:
        super().__init__(name)
        if max_endpoints <= 0:
            raise ValueError("maxNumOfEndpoints must be positive")
        self.max_endpoints = max_endpoints
        self.rng = rng if rng is not None else random.Random()


class MaxScorePicker(_RankingPicker):
    """Highest total first; equal totals are ordered at random so ties do not pile onto one pod."""

    type_name = "max-score-picker"

    def pick(self, totals: Sequence[float]) -> list[int]:
        """Indices of the top `max_endpoints` candidates, best first."""
        n = len(totals)
        want = min(self.max_endpoints, n)
        order = sorted(range(n), key=totals.__getitem__, reverse=True)
        out: list[int] = []
        i = 0
        while len(out) < want:
            top = totals[order[i]]
            j = i + 1
            while j < n and totals[order[j]] == top:
                j += 1
            need = want - len(out)
            if j - i == 1:
                out.append(order[i])
            else:
                out.extend(self.rng.sample(order[i:j], min(need, j - i)))
            i = j
        return out


class RandomPicker(_RankingPicker):
    """Uniformly random order (a baseline)."""

    type_name = "random-picker"

    def pick(self, totals: Sequence[float]) -> list[int]:
        n = len(totals)
        return self.rng.sample(range(n), min(self.max_endpoints, n))


class WeightedRandomPicker(_RankingPicker):
    """Candidates drawn at random in proportion to their totals (A-Res weighted sampling without replacement; the
    reference picker's weighted-random-picker); all totals at or below 0: uniformly at random."""

    type_name = "weighted-random-picker"

    def pick(self, totals: Sequence[float]) -> list[int]:
        n = len(totals)
        want = min(self.max_endpoints, n)
        if max(totals, default=0.0) <= 0.0:
            return self.rng.sample(range(n), want)
        draw = self.rng.random
        # key u^(1/w): the largest keys are a weighted sample; zero weights come last (key -inf)
        keys = [math.log(draw() or 1e-300) / w if w > 0 else -math.inf for w in totals]
        return sorted(range(n), key=keys.__getitem__, reverse=True)[:want]


class PickerParams(Section):
    max_endpoints: int = Field(default_of(MaxScorePicker, "max_endpoints"), gt=0, alias="maxNumOfEndpoints")  # GIE's


def _factory(cls: type[_RankingPicker]) -> PluginFactory[Any]:
    def build(name: str, p: PickerParams, deps: PluginDeps) -> Plugin:
        return cls(name, max_endpoints=p.max_endpoints, rng=deps.rng)
    return PluginFactory(cls.type_name, PickerParams, build)


FACTORIES: tuple[PluginFactory[Any], ...] = tuple(
    _factory(cls) for cls in (MaxScorePicker, RandomPicker, WeightedRandomPicker))
