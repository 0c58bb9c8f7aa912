"""Prefix sources are plugins of the plugin table: implied when their inputs exist, listed by the reference's names,
run in the table's order, and a new one is its module plus a line in the table."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest

from picker.core.requests import InferenceRequest
from picker.core.schema import ConfigError
from picker.endpoints.state import Endpoint
from picker.prefix.precise import PreciseIndex, PrecisePrefix
from picker.scheduling import config as scheduling_config
from picker.scheduling.config import PLUGIN_FACTORIES, build_scheduler
from picker.scheduling.context import SchedulingContext
from picker.scheduling.plugins import NoParams, Plugin, PluginDeps, PluginFactory
from picker.scheduling.producers import ApproximatePrefix, PreciseOverlay

ONE_PROFILE: dict[str, Any] = {
    "plugins": [{"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "prefix-cache-scorer"},
                                                     {"pluginRef": "max-score-picker"}]}],
}


def with_plugins(*extra: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(ONE_PROFILE)
    config["plugins"][:0] = extra
    return config


def test_the_prefix_sources_are_implied_by_their_inputs() -> None:
    assert [type(p) for p in build_scheduler(ONE_PROFILE).producers] == [ApproximatePrefix]
    precise = PrecisePrefix(PreciseIndex())
    assert [type(p) for p in build_scheduler(ONE_PROFILE, precise=precise).producers] == \
        [ApproximatePrefix, PreciseOverlay]


def test_listed_by_the_reference_names_they_run_in_the_tables_order() -> None:
    config = with_plugins({"type": "precise-prefix-cache-producer", "name": "kv"},
                          {"type": "approx-prefix-cache-producer", "name": "index"})
    config["schedulingProfiles"][0]["plugins"].insert(0, {"pluginRef": "index"})  # the reference allows it
    scheduler = build_scheduler(config, precise=PrecisePrefix(PreciseIndex()))
    assert [p.name for p in scheduler.producers] == ["index", "kv"]


def test_the_precise_view_without_kv_events_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"scheduling\.plugins\[0\]: the precise view needs the pods' KV events"):
        build_scheduler(with_plugins({"type": "precise-prefix-cache-producer"}))


class EveryPodHoldsTwo(Plugin):
    """A made-up prefix source: says every pod holds the prompt's first two blocks."""

    type_name = "test-two-blocks-producer"

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        ctx.matches = {e.address: min(2, len(ctx.keys)) for e in endpoints}

    def learned_chars_per_token(self) -> float | None:
        return None


def test_a_new_prefix_source_is_its_module_and_one_line_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(name: str, params: NoParams, deps: PluginDeps) -> Plugin:
        return EveryPodHoldsTwo(name)

    factories = {**PLUGIN_FACTORIES, EveryPodHoldsTwo.type_name: PluginFactory(EveryPodHoldsTwo.type_name, NoParams,
                                                                                build)}
    monkeypatch.setattr(scheduling_config, "PLUGIN_FACTORIES", factories)  # the table, with the one line added
    scheduler = build_scheduler(with_plugins({"type": EveryPodHoldsTwo.type_name}))
    assert [type(p) for p in scheduler.producers] == [ApproximatePrefix, EveryPodHoldsTwo]
    pods = [Endpoint.from_address("10.0.3.1:8000"), Endpoint.from_address("10.0.3.2:8000")]
    result = scheduler.schedule(InferenceRequest("r", "m", api=None, prompt_text="x" * 640), pods, 0.0)
    assert result.context is not None and result.context.matches == {p.address: 2 for p in pods}
    assert result.prefix_matched_blocks == 2  # the scorers read what it wrote
