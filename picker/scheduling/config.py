"""Scheduler configuration: a YAML/dict shaped like GIE's EndpointPickerConfig, with documented defaults.

    prefixCache:            # hashing + in-memory index (shared by every profile)
      blockChars: null      # characters per block; null = pods' vllm block_size x charsPerToken
      defaultBlockChars: 64 # with blockChars null: the width until the pods report their block size
      charsPerToken: 4
      maxPrefixBlocksToMatch: 256
      lruCapacityPerServer: 31250   # per-pod entries until the pod reports num_gpu_blocks
      ttlSeconds: 600
    models:
      base: []              # LoRA: which request models are base models / adapters
      adapters: []
      rewrites: []          # [{name, matches: [{model: {value}}], targets: [{modelRewrite, weight}]}]
    explain: true           # per-candidate score breakdown in every SchedulingResult
    plugins: [{type, name, parameters}]
    schedulingProfiles: [{name, plugins: [{pluginRef, weight}]}]

Top-level keys left out take the defaults below (`plugins` and `schedulingProfiles` as a whole, `prefixCache`
and `models` key by key). A `request-classifier` plugin chooses between profiles; without one the first profile
serves every request. Decoding is strict: an unknown key or a wrong type anywhere, down to each plugin's
`parameters`, is a ConfigError naming the key's path (`scheduling.plugins[2].parameters.ratioWeight: ...`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from picker.core.model_rewrite import RewriteRuleSpec
from picker.core.replicas import ReplicaView
from picker.core.schema import ConfigError, Section, decode
from picker.endpoints.saturation import SaturationThresholds
from picker.prefix.hashing import (
    CHARS_PER_TOKEN,
    DEFAULT_BLOCK_CHARS,
    DEFAULT_MAX_PREFIX_BLOCKS,
    IndexKey,
    PrefixHasher,
)
from picker.prefix.index import PrefixIndex
from picker.prefix.memory import DEFAULT_CAPACITY_BLOCKS, DEFAULT_TTL_SECONDS, InMemoryPrefixIndex
from picker.prefix.precise import PrecisePrefix
from picker.scheduling import (
    baselines,
    disagg,
    filters,
    fuzzy,
    media,
    picker,
    predicted,
    producers,
    profiles,
    reference_plugins,
    scorers,
    spreading,
)
from picker.scheduling.disagg import DisaggPdHeadersHandler, DisaggProfileHandler
from picker.scheduling.picker import MaxScorePicker
from picker.scheduling.plugins import (
    Filter,
    Picker,
    Plugin,
    PluginDeps,
    PluginFactory,
    PluginTimer,
    PredictionObserver,
    Scorer,
)
from picker.scheduling.producers import PrefixProducer
from picker.scheduling.profiles import Classifier, Profile, RequestClassifier, SingleProfile, WeightedScorer
from picker.scheduling.reference import API_VERSIONS, CONFIGURED_ELSEWHERE
from picker.scheduling.reference_plugins import SingleProfileHandler
from picker.scheduling.scheduler import PrefixAwareScheduler

# A large pool's candidates are sampled first (only those that can win are scored; none below 256 candidates),
# then the saturated ones go
_COMMON_HEAD = [{"pluginRef": "candidate-sample-filter"}, {"pluginRef": "saturation-filter"}]
_COMMON_TAIL = [{"pluginRef": "max-score-picker"}]

DEFAULT_CONFIG: dict[str, Any] = {
    "prefixCache": {
        "blockChars": None,
        "defaultBlockChars": DEFAULT_BLOCK_CHARS,
        "charsPerToken": CHARS_PER_TOKEN,
        "maxPrefixBlocksToMatch": DEFAULT_MAX_PREFIX_BLOCKS,
        "lruCapacityPerServer": DEFAULT_CAPACITY_BLOCKS,
        "ttlSeconds": DEFAULT_TTL_SECONDS,
    },
    "models": {"base": [], "adapters": [], "rewrites": []},
    "explain": True,
    # Each plugin's parameters default to its constructor's (picker/scheduling/*.py); only what the default
    # profiles set otherwise is written here (tests/test_defaults_once.py keeps it so).
    "plugins": [
        {"type": "candidate-sample-filter", "name": "candidate-sample-filter"},
        # thresholds: the admission section's queueThreshold / kvCacheThreshold unless set here
        {"type": "saturation-filter", "name": "saturation-filter"},
        {"type": "prefix-cache-scorer", "name": "prefix-cache-scorer"},
        {"type": "kv-cache-utilization-scorer", "name": "kv-cache-utilization-scorer"},
        {"type": "queue-scorer", "name": "queue-scorer"},
        {"type": "in-flight-load-scorer", "name": "in-flight-load-scorer",
         # prefillHalfLife/Weight: measured by bench/run_scheduling_sweep.py (see bench/README.md)
         "parameters": {"prefillHalfLife": 0.05, "prefillWeight": 4}},
        {"type": "lora-affinity-scorer", "name": "lora-affinity-scorer"},
        {"type": "session-affinity-scorer", "name": "session-affinity-scorer"},
        {"type": "cold-prefix-spreader", "name": "cold-prefix-spreader"},
        {"type": "max-score-picker", "name": "max-score-picker"},
        {"type": "request-classifier", "name": "request-classifier"},
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
            # prefix weighed above queue and KV use: measured better on every workload of the sweep
            {"pluginRef": "prefix-cache-scorer", "weight": 3},
            {"pluginRef": "queue-scorer", "weight": 1},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
            {"pluginRef": "in-flight-load-scorer", "weight": 3},
            {"pluginRef": "lora-affinity-scorer", "weight": 2},
            {"pluginRef": "session-affinity-scorer", "weight": 1},
            # above the in-flight scorer: a cold prompt is not dealt onto a pod still prefilling another
            {"pluginRef": "cold-prefix-spreader", "weight": 4},
            *_COMMON_TAIL,
        ]},
    ],
}

# Every plugin type a config may name, each with the factory that decodes its parameters. The prefix sources come
# first, in the order they run.
PLUGIN_FACTORIES: dict[str, PluginFactory[Any]] = {
    f.type_name: f for f in (*producers.FACTORIES, *filters.FACTORIES, *scorers.FACTORIES, *spreading.FACTORIES, *predicted.FACTORIES, *fuzzy.FACTORIES,
                             *baselines.FACTORIES, *picker.FACTORIES, *profiles.FACTORIES,
                             *reference_plugins.FACTORIES, *disagg.FACTORIES, *media.FACTORIES)
}


class PrefixCacheSection(Section):
    block_chars: int | None = Field(DEFAULT_CONFIG["prefixCache"]["blockChars"], gt=0)
    default_block_chars: int = Field(DEFAULT_BLOCK_CHARS, gt=0)
    chars_per_token: int = Field(CHARS_PER_TOKEN, gt=0)
    max_prefix_blocks_to_match: int = Field(DEFAULT_MAX_PREFIX_BLOCKS, gt=0)
    lru_capacity_per_server: int = Field(DEFAULT_CAPACITY_BLOCKS, gt=0)
    ttl_seconds: float | None = Field(DEFAULT_TTL_SECONDS, gt=0)


class ModelsSection(Section):
    base: list[str] = Field(default_factory=list)
    adapters: list[str] = Field(default_factory=list)
    rewrites: list[RewriteRuleSpec] = Field(default_factory=list)  # InferenceModelRewrite's rules, in order


class PluginSpec(Section):
    type: str
    name: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class PluginRef(Section):
    plugin_ref: str
    weight: float = Field(1.0, ge=0)


class ProfileSpec(Section):
    name: str
    plugins: list[PluginRef] = Field(default_factory=list)


def _default(key: str) -> Any:
    return copy.deepcopy(DEFAULT_CONFIG[key])


class SchedulingConfig(Section):
    """The `scheduling:` section, shaped like GIE's EndpointPickerConfig."""

    api_version: Literal[API_VERSIONS] | None = None  # type: ignore[valid-type]  # the reference's two
    kind: Literal["EndpointPickerConfig"] | None = None
    prefix_cache: PrefixCacheSection = Field(default_factory=PrefixCacheSection)
    models: ModelsSection = Field(default_factory=ModelsSection)
    explain: bool = True
    plugins: list[PluginSpec] = Field(default_factory=lambda: _default("plugins"))
    scheduling_profiles: list[ProfileSpec] = Field(default_factory=lambda: _default("schedulingProfiles"),
                                                   min_length=1)


SchedulingInput = SchedulingConfig | Mapping[str, Any] | None


def scheduling_config(config: SchedulingInput) -> SchedulingConfig:
    """The decoded section (None: every default); ConfigError names the bad key."""
    if isinstance(config, SchedulingConfig):
        return config
    return decode(SchedulingConfig, config, "scheduling")


def build_hasher(config: SchedulingInput = None, key: IndexKey | None = None) -> PrefixHasher:
    pc = scheduling_config(config).prefix_cache
    return PrefixHasher(pc.block_chars, pc.max_prefix_blocks_to_match, pc.chars_per_token, key,
                        pc.default_block_chars)


def build_prefix_index(config: SchedulingInput = None) -> InMemoryPrefixIndex:
    """The in-memory index the config asks for (the local half of a shared one, too)."""
    pc = scheduling_config(config).prefix_cache
    return InMemoryPrefixIndex(pc.lru_capacity_per_server, pc.ttl_seconds)


def _make_plugin(spec: PluginSpec, path: str, deps: PluginDeps) -> Plugin:
    factory = PLUGIN_FACTORIES.get(spec.type)
    if factory is None:
        raise ConfigError(f"{path}.type: unknown plugin type {spec.type!r} "
                          f"(known: {', '.join(sorted(PLUGIN_FACTORIES))})")
    params = decode(factory.params, spec.parameters, f"{path}.parameters")
    try:
        return factory.build(spec.name or spec.type, params, deps)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def build_scheduler(
    config: SchedulingInput = None,
    *,
    rng: random.Random | None = None,
    index: PrefixIndex | None = None,
    saturation: SaturationThresholds | None = None,
    observer: PredictionObserver | None = None,
    index_key: IndexKey | None = None,
    timer: PluginTimer | None = None,
    precise: PrecisePrefix | None = None,
    replicas: ReplicaView | None = None,
) -> PrefixAwareScheduler:
    """The full scheduler from its config (None = defaults). `index` swaps in a shared backend; `saturation`
    is the admission section's definition of a full pod (the saturation filter's default); `observer` hears how
    predictions compare with the pods' measurements; `index_key` keys what the index stores; `timer` hears how
    long plugins take."""
    cfg = scheduling_config(config)
    if index is None:
        index = build_prefix_index(cfg)
    hasher = build_hasher(cfg, index_key)
    deps = PluginDeps(rng=rng, base_models=tuple(cfg.models.base), adapters=tuple(cfg.models.adapters),
                      saturation=saturation if saturation is not None else SaturationThresholds(),
                      observer=observer, cache_room=index, prefix_index=index, hasher=hasher, precise=precise,
                      replicas=replicas)
    plugins: dict[str, Plugin] = {}
    positions: dict[str, int] = {}  # plugin name -> its place in scheduling.plugins (for errors)
    elsewhere: set[str] = set()  # names of plugins whose settings live in other sections (reference configs)
    for i, spec in enumerate(cfg.plugins):
        if spec.type in CONFIGURED_ELSEWHERE:
            if spec.parameters:
                raise ConfigError(f"scheduling.plugins[{i}].parameters: {spec.type} is configured outside the "
                                  "scheduler (load the config through `picker serve`, which moves them)")
            elsewhere.add(spec.name or spec.type)
            continue
        plugin = _make_plugin(spec, f"scheduling.plugins[{i}]", deps)
        if plugin.name in plugins or plugin.name in elsewhere:
            raise ConfigError(f"scheduling.plugins[{i}].name: duplicate plugin name {plugin.name!r}")
        plugins[plugin.name] = plugin
        positions[plugin.name] = i
    built: list[Profile] = []
    for i, pspec in enumerate(cfg.scheduling_profiles):
        profile = Profile(pspec.name)
        picker_set = False
        for j, ref in enumerate(pspec.plugins):
            where = f"scheduling.schedulingProfiles[{i}].plugins[{j}].pluginRef"
            used = plugins.get(ref.plugin_ref)
            if (used is None and ref.plugin_ref in elsewhere) or isinstance(used, PrefixProducer):
                continue  # a producer or data source named in a profile: the reference allows it; it runs for all
            if used is None:
                raise ConfigError(f"{where}: unknown plugin {ref.plugin_ref!r} (not in scheduling.plugins)")
            if isinstance(used, _HANDLERS):
                raise ConfigError(f"{where}: {ref.plugin_ref!r} is a profile handler: list it in plugins only")
            if isinstance(used, Picker):
                if picker_set:
                    raise ConfigError(f"{where}: a second picker in profile {pspec.name!r}")
                profile.picker = used
                picker_set = True
            elif isinstance(used, Scorer):
                profile.scorers.append(WeightedScorer(used, ref.weight))
            elif isinstance(used, Filter):
                profile.filters.append(used)
            else:
                raise ConfigError(f"{where}: {ref.plugin_ref!r} is not a filter, scorer or picker")
        if not picker_set:
            profile.picker = MaxScorePicker(rng=rng)
        built.append(profile)
    if len({p.name for p in built}) != len(built):
        raise ConfigError("scheduling.schedulingProfiles: profile names must be unique")
    classifier: Classifier
    handlers = [p for p in plugins.values() if isinstance(p, _HANDLERS)]
    if len(handlers) > 1:
        raise ConfigError(f"scheduling.plugins: one profile handler at most, not {len(handlers)} "
                          f"({', '.join(h.name for h in handlers)})")
    names = {p.name for p in built}
    handler = handlers[0] if handlers else None
    if isinstance(handler, SingleProfileHandler) and len(built) > 1:
        raise ConfigError(f"scheduling.plugins: {handler.name} runs one profile, not {len(built)}")
    if isinstance(handler, RequestClassifier) and len(built) > 1:
        for target in (handler.context_heavy_profile, handler.default_profile):
            if target not in names:
                raise ConfigError(f"scheduling.plugins: request-classifier names unknown profile {target!r}")
        classifier = handler
    elif isinstance(handler, DisaggProfileHandler):
        classifier = _disaggregating(handler, plugins, positions, names)
    else:
        classifier = SingleProfile(built[0].name)
    return PrefixAwareScheduler(built, classifier, index=index, hasher=hasher, explain=cfg.explain, timer=timer,
                                producers=_prefix_sources(plugins, deps))


def _prefix_sources(plugins: dict[str, Plugin], deps: PluginDeps) -> list[PrefixProducer]:
    """The producers the config lists, and those implied by the deps at hand (built with their defaults), in the
    plugin table's order: each reads what the ones before it wrote."""
    listed = [p for p in plugins.values() if isinstance(p, PrefixProducer)]
    types = {p.type_name for p in listed}
    for factory in PLUGIN_FACTORIES.values():
        if factory.implied is not None and factory.type_name not in types and factory.implied(deps):
            built = factory.build(factory.type_name, factory.params(), deps)
            assert isinstance(built, PrefixProducer), factory.type_name
            listed.append(built)
    order = {name: i for i, name in enumerate(PLUGIN_FACTORIES)}
    return sorted(listed, key=lambda p: order[p.type_name])


# Plugins that choose profiles: listed in `plugins` only, one per config.
_HANDLERS = (RequestClassifier, SingleProfileHandler, DisaggProfileHandler)


def _disaggregating(handler: DisaggProfileHandler, plugins: dict[str, Plugin], positions: dict[str, int],
                    profiles: set[str]) -> Classifier:
    """The P/D handler with its decider found, after checking the profiles it runs (and any header plugin's)."""
    where = f"scheduling.plugins[{positions[handler.name]}]"
    problem = handler.bind(plugins)
    if problem is not None:
        raise ConfigError(f"{where}.parameters: {problem}")
    for profile in handler.profiles():
        if profile not in profiles:
            raise ConfigError(f"{where}.parameters: runs unknown profile {profile!r} (not in scheduling.schedulingProfiles)")
    for plugin in plugins.values():
        if isinstance(plugin, DisaggPdHeadersHandler) and plugin.prefill_profile != handler.prefill_profile_name:
            raise ConfigError(f"scheduling.plugins[{positions[plugin.name]}].parameters.prefillProfile: "
                              f"{plugin.prefill_profile!r} is not the handler's prefill profile "
                              f"{handler.prefill_profile_name!r}")
    return handler


@dataclass(frozen=True, slots=True)
class StrategyDeps:
    """What a strategy is built with: the scheduling config (a baseline keeps its prefixCache, models and explain
    and runs its own profile), the run's random source, and what `picker serve` hands the scheduler."""

    config: SchedulingInput = None
    rng: random.Random | None = None
    index: PrefixIndex | None = None  # a shared index in place of the strategy's own (Redis/Valkey)
    saturation: SaturationThresholds | None = None
    observer: PredictionObserver | None = None
    index_key: IndexKey | None = None  # keys what a prefix index stores
    timer: PluginTimer | None = None
    precise: PrecisePrefix | None = None  # KV events: correct the picker's prefix matches
    replicas: ReplicaView | None = None  # this replica among those sharing the pool: its place, what they learned


def _plugin(plugin_type: str, name: str | None = None, **parameters: Any) -> dict[str, Any]:
    return {"type": plugin_type, "name": name or plugin_type, **({"parameters": parameters} if parameters else {})}


def _baseline(profile: str, *scorers: dict[str, Any], picker: str = "max-score-picker") -> dict[str, Any]:
    """A baseline as a scheduling config: one profile, named for it, of its scorers at weight 1 and a picker."""
    plugins = [*scorers, _plugin(picker)]
    return {"plugins": plugins,
            "schedulingProfiles": [{"name": profile, "plugins": [{"pluginRef": p["name"]} for p in plugins]}]}


# Every strategy `--strategy` may name: the full picker (the scheduling section as configured) and the baselines
# the benchmarks compare it with, each an ordinary one-profile config of the plugin table's plugins (their own in
# picker/scheduling/baselines.py). A new baseline is its plugin's module, its line in the plugin table and one here.
STRATEGY_CONFIGS: dict[str, dict[str, Any] | None] = {
    "picker": None,
    "round-robin": _baseline("round-robin", _plugin("round-robin-scorer")),
    "random": _baseline("random", picker="random-picker"),
    "least-load": _baseline("least-load", _plugin("queue-scorer", "queue"),
                            _plugin("kv-cache-utilization-scorer", "kv-cache")),  # cache-blind, weights 1:1
    # matched/total prefix ratio, no load guard (GIE's prefix scorer without load terms)
    "prefix-only": _baseline("prefix-only", _plugin("prefix-cache-scorer", "prefix", ratioWeight=1.0,
                                                    loadGuardInFlight=None, loadGuardWaiting=None)),
    "prefix-hash": _baseline("prefix-hash", _plugin("prefix-hash-scorer")),
    "hash-ring": _baseline("hash-ring", _plugin("hash-ring-scorer")),
    "bounded-load": _baseline("bounded-load", _plugin("bounded-load-scorer")),
    # SGLang router's cache_aware policy (vllm-router's too): the peers' routing, for the simulator
    "text-tree": _baseline("text-tree", _plugin("text-tree-scorer")),
}
STRATEGIES: tuple[str, ...] = tuple(STRATEGY_CONFIGS)
# Strategies that keep a prefix index (and so can share one through Redis/Valkey)
INDEXED_STRATEGIES = ("picker", "prefix-only")


def _known_strategy(name: str) -> str:
    if name not in STRATEGY_CONFIGS:
        raise ValueError(f"Input should be {', '.join(map(repr, STRATEGIES[:-1]))} or {STRATEGIES[-1]!r}")
    return name


StrategyName = Annotated[str, AfterValidator(_known_strategy)]  # a config's `strategy`: a key of the table


def strategy_config(name: str, config: SchedulingInput = None) -> SchedulingConfig:
    """The scheduling config strategy `name` runs: `config` itself for the picker; for a baseline, its profile
    with `config`'s prefixCache, models and explain."""
    if name not in STRATEGY_CONFIGS:
        raise ConfigError(f"strategy: unknown strategy {name!r} (known: {', '.join(STRATEGIES)})")
    cfg = scheduling_config(config)
    baseline = STRATEGY_CONFIGS[name]
    if baseline is None:
        return cfg
    own = scheduling_config(baseline)
    return cfg.model_copy(update={"plugins": own.plugins, "scheduling_profiles": own.scheduling_profiles})


def build_strategy(name: str, deps: StrategyDeps | None = None) -> PrefixAwareScheduler:
    """A scheduler by strategy name (benchmarks compare them), built with `deps`."""
    d = deps if deps is not None else StrategyDeps()
    return build_scheduler(strategy_config(name, d.config), rng=d.rng, index=d.index, saturation=d.saturation,
                           observer=d.observer, index_key=d.index_key, timer=d.timer, precise=d.precise,
                           replicas=d.replicas)
