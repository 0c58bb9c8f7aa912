"""Scheduler configs the benchmarks try beside the defaults: an opt-in scorer on top of them, every pod scored (no
sample), and routing on predicted time to first token (docs/scheduling.md has it as YAML for `--config-file`)."""

from __future__ import annotations

import copy
from typing import Any

from picker.scheduling import filters, predicted
from picker.scheduling.config import DEFAULT_CONFIG


def with_scorer(config: dict[str, Any], plugin_type: str, weight: float,
                parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of `config` with one more scorer, of `plugin_type`, at `weight` in every profile (before the
    picker): how an opt-in scorer is tried on top of the defaults."""
    out = copy.deepcopy(config)
    out["plugins"].append({"type": plugin_type, "name": plugin_type, **({"parameters": parameters} if parameters
                                                                        else {})})
    for profile in out["schedulingProfiles"]:
        plugins = profile["plugins"]
        plugins.insert(len(plugins) - 1, {"pluginRef": plugin_type, "weight": weight})
    return out


# Route on predicted time to first token (picker/scheduling/predicted.py): the pod predicted to start streaming
# soonest wins; the prefix and load scorers, with small weights, only break its ties; LoRA affinity still counts.
# Opt-in for now (`scheduling:` in --config-file); bench/README.md has it against the defaults.
PREDICTED_TTFT_CONFIG: dict[str, Any] = {
    "plugins": [
        {"type": "predicted-ttft-scorer", "name": "predicted-ttft-scorer"},
        {"type": "prefix-cache-scorer", "name": "prefix-cache-scorer"},
        {"type": "in-flight-load-scorer", "name": "in-flight-load-scorer"},
        {"type": "lora-affinity-scorer", "name": "lora-affinity-scorer"},
        {"type": "max-score-picker", "name": "max-score-picker", "parameters": {"maxNumOfEndpoints": 3}},
    ],
    "schedulingProfiles": [{"name": "predicted-ttft", "plugins": [
        {"pluginRef": "predicted-ttft-scorer", "weight": 1},
        {"pluginRef": "prefix-cache-scorer", "weight": 0.01},
        {"pluginRef": "in-flight-load-scorer", "weight": 0.001},
        {"pluginRef": "lora-affinity-scorer", "weight": 0.5},
        {"pluginRef": "max-score-picker"},
    ]}],
}


def every_pod_scheduling() -> dict[str, Any]:
    """The defaults without `candidate-sample-filter`: every candidate scored, however large the pool (what the
    sample is measured against, bench/studies/scale.md "One picker process as the pool grows")."""
    out = copy.deepcopy(DEFAULT_CONFIG)
    out["plugins"] = [p for p in out["plugins"] if p["type"] != filters.CandidateSampleFilter.type_name]
    for profile in out["schedulingProfiles"]:
        profile["plugins"] = [p for p in profile["plugins"] if p["pluginRef"] != "candidate-sample-filter"]
    return out


def predicted_ttft_scheduling(**parameters: Any) -> dict[str, Any]:
    """A copy of PREDICTED_TTFT_CONFIG with the predicted-ttft-scorer's `parameters` (named as in a config file,
    e.g. `podTimeScale=0.5`) set: how the benchmarks and tests vary it."""
    config = copy.deepcopy(PREDICTED_TTFT_CONFIG)
    for plugin in config["plugins"]:
        if plugin["type"] == predicted.PredictedTTFTScorer.type_name:
            plugin["parameters"] = {**plugin.get("parameters", {}), **parameters}
    return config
