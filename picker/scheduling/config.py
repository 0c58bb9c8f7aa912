"""Scheduler configuration: a YAML/dict shaped like GIE's EndpointPickerConfig, with documented defaults.

    prefixCache:            # hashing + in-memory index (shared by every profile)
      blockChars: null      # characters per block; null = pods' vllm block_size x charsPerToken (64 until known)
      charsPerToken: 4
      maxPrefixBlocksToMatch: 256
      lruCapacityPerServer: 31250   # per-pod entries until the pod reports num_gpu_blocks
      ttlSeconds: 600
    models: {base: [], adapters: []}   # LoRA: which request models are base models / adapters
    explain: true           # per-candidate score breakdown in every SchedulingResult
    plugins: [{type, name, parameters}]
    schedulingProfiles: [{name, plugins: [{pluginRef, weight}]}]

Top-level keys left out take the defaults below. A `request-classifier` plugin chooses between profiles;
without one the first profile serves every request.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from picker.prefix.hashing import CHARS_PER_TOKEN, DEFAULT_MAX_PREFIX_BLOCKS, PrefixHasher
from picker.prefix.index import PrefixIndex
from picker.prefix.memory import DEFAULT_CAPACITY_BLOCKS, DEFAULT_TTL_SECONDS, InMemoryPrefixIndex
from picker.scheduling.filters import SaturationFilter, SubsetFilter
from picker.scheduling.picker import MaxScorePicker, RandomPicker
from picker.scheduling.plugins import Filter, Plugin, Scorer
from picker.scheduling.profiles import Classifier, Profile, RequestClassifier, SingleProfile, WeightedScorer
from picker.scheduling.scheduler import PrefixAwareScheduler
from picker.scheduling.scorers import (
    ColdPrefixSpreader,
    InFlightLoadScorer,
    KVCacheUtilizationScorer,
    LoraAffinityScorer,
    PrefixCacheScorer,
    QueueScorer,
    SessionAffinityScorer,
)
from picker.scheduling.strategies import (
    LeastLoadScheduler,
    PrefixHashScheduler,
    PrefixOnlyScheduler,
    RandomScheduler,
    RoundRobinScheduler,
)
from picker.scheduling.types import Scheduler

_COMMON_HEAD = [{"pluginRef": "subset-filter"}, {"pluginRef": "saturation-filter"}]
_COMMON_TAIL = [{"pluginRef": "max-score-picker"}]

DEFAULT_CONFIG: dict[str, Any] = {
    "prefixCache": {
        "blockChars": None,
        "charsPerToken": CHARS_PER_TOKEN,
        "maxPrefixBlocksToMatch": DEFAULT_MAX_PREFIX_BLOCKS,
        "lruCapacityPerServer": DEFAULT_CAPACITY_BLOCKS,
        "ttlSeconds": DEFAULT_TTL_SECONDS,
    },
    "models": {"base": [], "adapters": []},
    "explain": True,
    "plugins": [
        {"type": "subset-filter", "name": "subset-filter"},
        {"type": "saturation-filter", "name": "saturation-filter",
         "parameters": {"queueThreshold": 5, "kvCacheThreshold": 0.8}},
        {"type": "prefix-cache-scorer", "name": "prefix-cache-scorer",
         "parameters": {"ratioWeight": 0.5, "fullCreditChars": 4096, "loadGuardInFlight": 8,
                        "loadGuardWaiting": 4, "guardPenalty": 0.0}},
        {"type": "kv-cache-utilization-scorer", "name": "kv-cache-utilization-scorer"},
        {"type": "queue-scorer", "name": "queue-scorer"},
        {"type": "in-flight-load-scorer", "name": "in-flight-load-scorer",
         # prefillHalfLife/Weight: measured by bench/run_scheduling_sweep.py (see bench/README.md)
         "parameters": {"tokensPerRequest": 4096, "slack": 1.0, "prefillHalfLife": 0.05, "prefillWeight": 4}},
        {"type": "lora-affinity-scorer", "name": "lora-affinity-scorer"},
        {"type": "session-affinity-scorer", "name": "session-affinity-scorer", "parameters": {"maxSessions": 10000}},
        {"type": "cold-prefix-spreader", "name": "cold-prefix-spreader", "parameters": {"recencyWeight": 0.5}},
        {"type": "max-score-picker", "name": "max-score-picker", "parameters": {"maxNumOfEndpoints": 3}},
        {"type": "request-classifier", "name": "request-classifier",
         "parameters": {"longPromptChars": 8192, "longPrefixChars": 2048,
                        "contextHeavyProfile": "context-heavy", "defaultProfile": "bursty-chat"}},
    ],
    "schedulingProfiles": [
        {"name": "context-heavy", "plugins": [
            *_COMMON_HEAD,
            {"pluginRef": "prefix-cache-scorer", "weight": 5},
            {"pluginRef": "queue-scorer", "weight": 1},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
            {"pluginRef": "in-flight-load-scorer", "weight": 1},
            {"pluginRef": "lora-affinity-scorer", "weight": 2},
            {"pluginRef": "session-affinity-scorer", "weight": 1},
            {"pluginRef": "cold-prefix-spreader", "weight": 2},
            *_COMMON_TAIL,
        ]},
        {"name": "bursty-chat", "plugins": [
            *_COMMON_HEAD,
            # prefix 3 / queue 1 / kv 1 (was 1 / 2 / 2): measured better on every workload of the sweep
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "queue-scorer", "weight": 1},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
            {"pluginRef": "in-flight-load-scorer", "weight": 3},
            {"pluginRef": "lora-affinity-scorer", "weight": 2},
            {"pluginRef": "session-affinity-scorer", "weight": 1},
            {"pluginRef": "cold-prefix-spreader", "weight": 1},
            *_COMMON_TAIL,
        ]},
    ],
}

# Parameter names that do not follow the camelCase -> snake_case rule (GIE spellings).
_RENAMES = {"maxNumOfEndpoints": "max_endpoints"}


def _snake(name: str) -> str:
    return _RENAMES.get(name) or re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


PluginFactory = Callable[..., Plugin]

PLUGIN_TYPES: dict[str, PluginFactory] = {
    cls.type_name: cls
    for cls in (
        SubsetFilter,
        SaturationFilter,
        PrefixCacheScorer,
        KVCacheUtilizationScorer,
        QueueScorer,
        InFlightLoadScorer,
        LoraAffinityScorer,
        SessionAffinityScorer,
        ColdPrefixSpreader,
        MaxScorePicker,
        RandomPicker,
        RequestClassifier,
    )
}


def load_config(path: str) -> dict[str, Any]:
    """Read a YAML scheduler config file (the `--config-file` flag)."""
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: scheduler config must be a mapping")
    return data


def merged_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Defaults with the user's top-level keys laid over them (prefixCache/models merge key by key)."""
    out = copy.deepcopy(DEFAULT_CONFIG)
    for key, value in (config or {}).items():
        if key in ("prefixCache", "models") and isinstance(value, Mapping):
            out[key].update(value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _make_plugin(spec: Mapping[str, Any], cfg: Mapping[str, Any], rng: random.Random | None) -> Plugin:
    kind = spec.get("type")
    factory = PLUGIN_TYPES.get(str(kind))
    if factory is None:
        raise ValueError(f"unknown plugin type {kind!r} (known: {', '.join(sorted(PLUGIN_TYPES))})")
    params = {_snake(k): v for k, v in (spec.get("parameters") or {}).items()}
    if factory in (MaxScorePicker, RandomPicker):
        params.setdefault("rng", rng)
    if factory is LoraAffinityScorer:
        params.setdefault("base_models", tuple(cfg["models"].get("base") or ()))
        params.setdefault("adapters", tuple(cfg["models"].get("adapters") or ()))
    try:
        return factory(spec.get("name") or kind, **params)
    except TypeError as exc:
        raise ValueError(f"plugin {spec.get('name') or kind!r}: bad parameters: {exc}") from None


def build_scheduler(
    config: Mapping[str, Any] | None = None,
    *,
    rng: random.Random | None = None,
    index: PrefixIndex | None = None,
) -> PrefixAwareScheduler:
    """The full scheduler from a config dict (None = defaults). `index` swaps in a shared backend."""
    cfg = merged_config(config)
    pc = cfg["prefixCache"]
    plugins: dict[str, Plugin] = {}
    for spec in cfg["plugins"]:
        plugin = _make_plugin(spec, cfg, rng)
        if plugin.name in plugins:
            raise ValueError(f"duplicate plugin name {plugin.name!r}")
        plugins[plugin.name] = plugin
    profiles: list[Profile] = []
    for pspec in cfg["schedulingProfiles"]:
        profile = Profile(str(pspec["name"]))
        picker_set = False
        for ref in pspec.get("plugins") or ():
            name = ref.get("pluginRef")
            used = plugins.get(name)
            if used is None:
                raise ValueError(f"profile {profile.name!r}: unknown pluginRef {name!r}")
            if isinstance(used, MaxScorePicker | RandomPicker):
                profile.picker = used
                picker_set = True
            elif isinstance(used, Scorer):
                profile.scorers.append(WeightedScorer(used, float(ref.get("weight", 1.0))))
            elif isinstance(used, Filter):
                profile.filters.append(used)
            else:
                raise ValueError(f"profile {profile.name!r}: {name!r} is not a filter, scorer or picker")
        if not picker_set:
            profile.picker = MaxScorePicker(rng=rng)
        profiles.append(profile)
    if not profiles:
        raise ValueError("schedulingProfiles must name at least one profile")
    classifier: Classifier
    classifiers = [p for p in plugins.values() if isinstance(p, RequestClassifier)]
    names = {p.name for p in profiles}
    if classifiers and len(profiles) > 1:
        chosen = classifiers[0]
        for target in (chosen.context_heavy_profile, chosen.default_profile):
            if target not in names:
                raise ValueError(f"request-classifier names unknown profile {target!r}")
        classifier = chosen
    else:
        classifier = SingleProfile(profiles[0].name)
    if index is None:
        index = InMemoryPrefixIndex(int(pc["lruCapacityPerServer"]), pc["ttlSeconds"])
    hasher = PrefixHasher(pc["blockChars"], int(pc["maxPrefixBlocksToMatch"]), int(pc["charsPerToken"]))
    return PrefixAwareScheduler(profiles, classifier, index=index, hasher=hasher, explain=bool(cfg["explain"]))


STRATEGIES = ("picker", "round-robin", "random", "least-load", "prefix-only", "prefix-hash")


def build_strategy(
    name: str,
    *,
    config: Mapping[str, Any] | None = None,
    rng: random.Random | None = None,
    index: PrefixIndex | None = None,
) -> Scheduler:
    """A scheduler by strategy name (benchmarks compare them): picker, round-robin, random, least-load, prefix-only,
    prefix-hash."""
    if name in ("picker", "prefix-aware"):
        return build_scheduler(config, rng=rng, index=index)
    if name == "round-robin":
        return RoundRobinScheduler()
    if name == "random":
        return RandomScheduler(rng)
    if name == "least-load":
        return LeastLoadScheduler(rng)
    if name == "prefix-hash":
        return PrefixHashScheduler()
    if name == "prefix-only":
        cfg = merged_config(config)["prefixCache"]
        hasher = PrefixHasher(cfg["blockChars"], int(cfg["maxPrefixBlocksToMatch"]), int(cfg["charsPerToken"]))
        if index is None:
            index = InMemoryPrefixIndex(int(cfg["lruCapacityPerServer"]), cfg["ttlSeconds"])
        return PrefixOnlyScheduler(rng, index=index, hasher=hasher)
    raise ValueError(f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})")
