"""Pickers turn weighted totals into a ranked list: best first, then fallbacks for Envoy to retry."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from picker.scheduling.plugins import Plugin, PluginDeps, PluginFactory
from picker.schema import Section


class MaxScorePicker(Plugin):
    """Highest total first; equal totals are ordered at random so ties do not pile onto one pod."""

    type_name = "max-score-picker"

    def __init__(self, name: str | None = None, *, max_endpoints: int = 3, rng: random.Random | None = None) -> None:
        super().__init__(name)
        if max_endpoints <= 0:
            raise ValueError("maxNumOfEndpoints must be positive")
        self.max_endpoints = max_endpoints
        self.rng = rng if rng is not None else random.Random()

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


class RandomPicker(Plugin):
    """Uniformly random order (a baseline)."""

    type_name = "random-picker"

    def __init__(self, name: str | None = None, *, max_endpoints: int = 3, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self.max_endpoints = max_endpoints
        self.rng = rng if rng is not None else random.Random()

    def pick(self, totals: Sequence[float]) -> list[int]:
        n = len(totals)
        return self.rng.sample(range(n), min(self.max_endpoints, n))


class PickerParams(Section):
    max_endpoints: int = Field(3, gt=0, alias="maxNumOfEndpoints")  # GIE's spelling


def _max_score(name: str, p: PickerParams, deps: PluginDeps) -> Plugin:
    return MaxScorePicker(name, max_endpoints=p.max_endpoints, rng=deps.rng)


def _random(name: str, p: PickerParams, deps: PluginDeps) -> Plugin:
    return RandomPicker(name, max_endpoints=p.max_endpoints, rng=deps.rng)


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(MaxScorePicker.type_name, PickerParams, _max_score),
    PluginFactory(RandomPicker.type_name, PickerParams, _random),
)
