"""The reference picker's EndpointPickerConfig, read as it is: a drop-in for GIE's endpoint picker (now llm-d's
router) takes its config file unchanged.

A document whose `kind` is `EndpointPickerConfig` (apiVersion `llm-d.ai/v1alpha1`, or the older
`inference.networking.x-k8s.io/v1alpha1`) is the whole config file; the same plugin vocabulary also works inside our
own `scheduling:` section. What the reference spreads over plugins that are not part of scheduling here lands in
the section that owns it:

- prefix hashing (`approx-prefix-cache-producer`'s parameters, and `prefix-cache-scorer`'s older `blockSize`,
  `maxPrefixBlocksToMatch`, `lruCapacityPerServer`) -> `scheduling.prefixCache` (the producer itself is ours:
  `picker.scheduling.producers`);
- where pods' metrics are read (`metrics-data-source`) -> the `model-server-metrics-*` options;
- when a pod counts as full (`utilization-detector`, `saturationDetector`) -> `admission`;
- `core-metrics-extractor` (vLLM), `openai-parser`, `token-producer` (estimating), `inflight-load-producer`: what
  the picker does anyway.

Scheduling plugins of the reference map onto ours by type (the ones we had no twin for are in
`reference_plugins`); profile handlers and pickers too. A reference plugin type we do not implement is a
ConfigError naming it and saying why, never a traceback; so is a parameter we cannot honour. Flow control and
feature gates that change nothing here are logged as one warning each.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from picker.core.requests import CHARS_PER_TOKEN
from picker.core.schema import ConfigError, Duration, Section, decode
from picker.prefix.hashing import DEFAULT_BLOCK_CHARS
from picker.scheduling.media import REFERENCE_PRODUCER, REFERENCE_TYPE, ReferenceProducerParams

API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
KIND = "EndpointPickerConfig"
DOCUMENT_FIELDS = ("apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer", "flowControl",
                   "requestHandler", "saturationDetector", "parser")

# Plugin types whose settings this module moves to the section that owns them: the scheduler skips them (and
# references to them in profiles, which the reference allows for non-scheduling plugins).
CONFIGURED_ELSEWHERE = frozenset({
    "metrics-data-source", "core-metrics-extractor", "utilization-detector",
    "openai-parser", "token-producer", "inflight-load-producer", REFERENCE_PRODUCER,
})

# The reference's plugin types we do not implement, and why (the error a config naming one gets).
_PD = ("encode disaggregation, P2P KV sources and topology affinity are not implemented (prefill/decode "
       "disaggregation is: disagg-profile-handler)")
_PRECISE = ("KV-event (precise) prefix routing is not a plugin here: set kvEventsEndpoint or kvEventsPort "
            "(--kv-events-endpoint / --kv-events-port) and the prefix scorers read the pods' own view")
_LATENCY = "the latency-predictor sidecars are not used; picker's own predicted-ttft-scorer predicts TTFT"
NOT_IMPLEMENTED: dict[str, str] = {
    **dict.fromkeys(("encode-filter", "always-disagg-multimodal-decider", "p2p-source-producer",
                     "topology-affinity-filter", "topology-affinity-scorer", "topology-extractor"), _PD),
    **dict.fromkeys(("precise-prefix-cache-scorer", "endpoint-notification-source",
                     "burst-prefix-cache-producer"), _PRECISE),
    **dict.fromkeys(("predicted-latency-producer", "latency-scorer", "slo-headroom-tier-filter",
                     "latency-slo-admitter", "prefix-cache-affinity-filter"), _LATENCY),
    "header-profile-handler": "profiles are chosen by picker's request-classifier",
    "passthrough-parser": "picker routes on the OpenAI-style body it parses; a pass-through parser cannot feed it",
    "anthropic-parser": "picker parses OpenAI-style bodies only",
    "vllmhttp-parser": "picker parses OpenAI-style bodies only",
    "vllmgrpc-parser": "picker parses OpenAI-style bodies only",
    "sglanghttp-parser": "picker parses OpenAI-style bodies only",
    "vertexai-parser": "picker parses OpenAI-style bodies only",
    "concurrency-detector": "admission counts waiting requests and KV-cache use (utilization-detector)",
    "probabilistic-admitter": "admission sheds sheddable requests by saturation thresholds (utilization-detector)",
    "token-load-scorer": "use in-flight-load-scorer (in-flight requests and tokens)",
    "context-length-aware": "pods carry no context-length ranges here",
    "label-selector-filter": "select pods with --endpoint-selector or the InferencePool",
    "by-label-selector": "select pods with --endpoint-selector or the InferencePool",
    "by-label": "select pods with --endpoint-selector or the InferencePool",
    "session-affinity-filter": "session-affinity-scorer keeps sessions on their pod",
    "utilization-filter": "saturation-filter drops pods past the admission thresholds",
    "endpoint-attribute-filter": "pod attributes beyond vLLM's metrics are not read",
    "endpoint-attribute-scorer": "pod attributes beyond vLLM's metrics are not read",
    "header-label-affinity-scorer": "pod labels are not matched against headers",
    "models-data-source": "served models are read from the pods' metrics",
    "models-data-extractor": "served models are read from the pods' metrics",
    "dcgm-data-source": "GPU utilization (DCGM) is not read",
    "dcgm-extractor": "GPU utilization (DCGM) is not read",
    "file-discovery": "use --endpoints-file",
    "request-attribute-reporter": "response dynamic metadata is not written",
    "agent-identity": "session-affinity-scorer reads x-session-id",
    "session-id-producer": "session-affinity-scorer reads x-session-id",
    **dict.fromkeys(("multicluster-approx-prefix-cache-producer", "multicluster-prefix-cache-scorer",
                     "multicluster-queue-scorer", "multicluster-kv-cache-utilization-scorer",
                     "multicluster-metrics-data-source", "multicluster-metrics-extractor",
                     "multicluster-file-discovery", "multicluster-session-affinity-filter"),
                    "multi-cluster pools are not implemented"),
}

# Feature gates the reference knows; none changes anything here.
_FEATURE_GATES = {
    "flowControl": "picker's admission section queues and sheds by itself",
    "haPopulateNonLeaderDatastore": "picker replicas are active-active, each with its own view",
    "dataLayer": "picker's data layer is always on",
    "prepareDataPlugins": "picker's data layer is always on",
}


@dataclass
class Adapted:
    """A config in our layout, and the warnings to log once (settings that change nothing here)."""

    config: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


class _Params(Section):
    """Parameters of a reference plugin, decoded as strictly as ours."""


class ApproxPrefixParams(_Params):
    auto_tune: bool = True
    block_size_tokens: int | None = Field(None, gt=0)
    block_size: int | None = Field(None, gt=0)  # characters (deprecated in the reference)
    max_prefix_blocks_to_match: int | None = Field(None, gt=0)
    max_prefix_tokens_to_match: int | None = Field(None, ge=0)
    lru_capacity_per_server: int | None = Field(None, gt=0)


class MetricsSourceParams(_Params):
    scheme: Literal["http", "https"] = "http"
    path: str = Field("/metrics", pattern=r"^/")
    port: int | None = Field(None, gt=0, le=65535)
    insecure_skip_verify: bool = True
    interval: Duration | None = Field(None, gt=0)


class MetricsExtractorParams(_Params):
    default_engine: Literal["vllm"] = "vllm"  # other engines: not yet
    engine_label_key: str = "llm-d.ai/engine-type"


class DataParallelParams(_Params):
    """The reference's deprecated `data-parallel-profile-handler`: its pool lists one port per rank (the sidecar
    listens on each), and it sent every request to `primaryPort` naming the rank's ip:port in
    `X-Data-Parallel-Endpoint`. Here each listed port is an endpoint and gets its requests itself."""

    primary_port: int = Field(8000, ge=0, le=65535)  # 0: its default, as the reference reads it


class TokenProducerParams(_Params):
    model_name: str = ""  # estimating needs no model; a `vllm` backend (real tokenization) is not supported


class UtilizationParams(_Params):
    queue_depth_threshold: float = Field(5, gt=0)
    kv_cache_util_threshold: float = Field(0.8, gt=0, le=1)
    metrics_staleness_threshold: Duration = Field(0.2, ge=0)
    headroom: float = Field(0.0, ge=0, le=0)  # only 0: a pod is full at its thresholds


_PREFIX_HASHING_KEYS = ("autoTune", "blockSizeTokens", "blockSize", "hashBlockSize", "maxPrefixBlocksToMatch",
                        "maxPrefixTokensToMatch", "lruCapacityPerServer")


def is_endpoint_picker_config(data: Mapping[str, Any]) -> bool:
    return "apiVersion" in data or data.get("kind") == KIND


def adapt_document(data: Mapping[str, Any]) -> Adapted:
    """A whole EndpointPickerConfig document as our config file: `scheduling`, `admission` and the serve options
    its plugins imply. ConfigError names the key as the document spells it."""
    version, kind = data.get("apiVersion"), data.get("kind")
    if version not in API_VERSIONS:
        raise ConfigError(f"apiVersion: {version!r} is not one this picker reads ({', '.join(API_VERSIONS)})")
    if kind != KIND:
        raise ConfigError(f"kind: {kind!r}, expected {KIND}")
    for key in data:
        if key not in DOCUMENT_FIELDS:
            raise ConfigError(f"{key}: not a field of {KIND} ({', '.join(DOCUMENT_FIELDS)})")
    adapted = Adapted({})
    scheduling: dict[str, Any] = {"apiVersion": version, "kind": kind}
    for key in ("plugins", "schedulingProfiles"):
        if key in data:
            scheduling[key] = copy.deepcopy(data[key])
    adapted.config["scheduling"] = scheduling
    adapted.warnings += _feature_gates(data.get("featureGates"))
    _adapt_plugins(scheduling, "", adapted)
    declared = {str(spec.get("name") or spec.get("type")): str(spec.get("type"))
                for spec in scheduling.get("plugins") or [] if isinstance(spec, Mapping)}
    _check_data_layer(data.get("dataLayer"), declared)
    _check_parsers(data.get("requestHandler"), data.get("parser"), declared)
    _saturation_detector(data, declared, scheduling, adapted)
    flow = data.get("flowControl")
    if isinstance(flow, Mapping) and any(k != "saturationDetector" for k in flow):
        adapted.warnings.append("flowControl: ignored (picker's admission section queues and sheds requests; "
                                "its settings are under admission)")
    return adapted


def adapt_section(section: Mapping[str, Any], path: str = "scheduling") -> Adapted:
    """Our `scheduling:` section with the reference's plugin types and parameters in it, in our layout."""
    scheduling = copy.deepcopy(dict(section))
    adapted = Adapted({})
    _adapt_plugins(scheduling, f"{path}.", adapted)
    adapted.config["scheduling"] = scheduling
    return adapted


def _feature_gates(gates: Any) -> list[str]:
    if gates is None:
        return []
    if not isinstance(gates, list):
        raise ConfigError("featureGates: must be a list of gate names")
    warnings = []
    for i, gate in enumerate(gates):
        name = str(gate).split("=", 1)[0].strip()
        if name not in _FEATURE_GATES:
            raise ConfigError(f"featureGates[{i}]: feature gate {name!r} is unknown "
                              f"(known: {', '.join(_FEATURE_GATES)})")
        warnings.append(f"featureGates: {name} changes nothing here ({_FEATURE_GATES[name]})")
    return warnings


def _adapt_plugins(scheduling: dict[str, Any], prefix: str, adapted: Adapted) -> None:
    """Move the settings of plugins configured elsewhere into their sections, in place; refuse the ones we lack."""
    plugins = scheduling.get("plugins")
    if not isinstance(plugins, list):
        return
    prefix_cache: dict[str, Any] = {}
    media_entries = 0
    for i, spec in enumerate(plugins):
        if not isinstance(spec, dict):
            continue
        kind, where = spec.get("type"), f"{prefix}plugins[{i}]"
        if kind in NOT_IMPLEMENTED:
            raise ConfigError(f"{where}.type: {kind!r} (a plugin of the reference picker) is not implemented here: "
                              f"{NOT_IMPLEMENTED[kind]}")
        params = spec.get("parameters") or {}
        if not isinstance(params, Mapping):
            continue  # our decoder names it
        if kind == "prefix-cache-scorer":
            hashing = {k: params[k] for k in _PREFIX_HASHING_KEYS if k in params}
            ours = {k: v for k, v in params.items() if k not in _PREFIX_HASHING_KEYS}
            _prefix_hashing(hashing, f"{where}.parameters", prefix_cache)
            spec["parameters"] = _prefix_scoring(ours, f"{where}.parameters")
        elif kind == "approx-prefix-cache-producer":
            _prefix_hashing(params, f"{where}.parameters", prefix_cache)
            spec["parameters"] = {}
        elif kind == REFERENCE_PRODUCER:  # its cache size goes to the media scorers, which remember on their own
            media_entries = decode(ReferenceProducerParams, params, f"{where}.parameters").entries_per_pod()
            spec["parameters"] = {}
        elif kind == "metrics-data-source":
            p = decode(MetricsSourceParams, params, f"{where}.parameters")
            options: dict[str, Any] = {"model-server-metrics-scheme": p.scheme, "model-server-metrics-path": p.path,
                                       "model-server-metrics-https-insecure-skip-verify": p.insecure_skip_verify}
            if p.port is not None:
                options["model-server-metrics-port"] = p.port
            if p.interval is not None:
                options["refresh-metrics-interval"] = f"{p.interval}s"
            adapted.config.update(options)
            spec["parameters"] = {}
        elif kind == "core-metrics-extractor":
            decode(MetricsExtractorParams, params, f"{where}.parameters")
            spec["parameters"] = {}
        elif kind == "token-producer":
            decode(TokenProducerParams, params, f"{where}.parameters")
            spec["parameters"] = {}
        elif kind == "data-parallel-profile-handler":
            port = decode(DataParallelParams, params, f"{where}.parameters").primary_port or 8000
            spec["type"], spec["parameters"] = "single-profile-handler", {}
            adapted.warnings.append(
                f"{where}: data-parallel-profile-handler runs as single-profile-handler: each rank port the pool "
                f"lists is an endpoint and is sent its requests directly (the reference's own migration), not "
                f"through primaryPort {port} with X-Data-Parallel-Endpoint; a server whose ranks share one port is "
                "routed rank by rank with x-data-parallel-rank")
        elif kind == "utilization-detector":
            adapted.config["admission"] = _utilization(params, f"{where}.parameters")
            spec["parameters"] = {}
        elif kind in ("openai-parser", "inflight-load-producer") and params:
            raise ConfigError(f"{where}.parameters: {kind} takes none here")
    for spec in plugins:
        if media_entries and isinstance(spec, dict) and spec.get("type") == REFERENCE_TYPE:
            params = spec.setdefault("parameters", {})
            if isinstance(params, dict):
                params.setdefault("entriesPerPod", media_entries)
    if prefix_cache:
        given = scheduling.get("prefixCache")
        if isinstance(given, Mapping):
            for key, value in prefix_cache.items():
                if key in given and given[key] != value:
                    raise ConfigError(f"{prefix}prefixCache.{key}: {given[key]!r} disagrees with the prefix "
                                      f"plugin's {value!r}")
            prefix_cache = {**given, **prefix_cache}
        scheduling["prefixCache"] = prefix_cache


def _prefix_hashing(params: Mapping[str, Any], where: str, out: dict[str, Any]) -> None:
    """The reference's hashing parameters as our prefixCache keys: blocks in characters (its `blockSize`) or
    tokens (`blockSizeTokens`, at our chars-per-token), a match limit in blocks or tokens, the LRU capacity (which
    here, as with its autoTune, follows the pods' reported num_gpu_blocks once known)."""
    data = dict(params)
    if "hashBlockSize" in data:  # its earliest name for blockSize
        data.setdefault("blockSize", data.pop("hashBlockSize"))
    p = decode(ApproxPrefixParams, data, where)
    width = p.block_size_tokens * CHARS_PER_TOKEN if p.block_size_tokens is not None else p.block_size
    if width is not None:
        # autoTune (the default): the pods' own block size wins once they report it, the width until then
        out["defaultBlockChars" if p.auto_tune else "blockChars"] = width
    if p.max_prefix_tokens_to_match:
        blocks_of = width or DEFAULT_BLOCK_CHARS
        out["maxPrefixBlocksToMatch"] = max(1, p.max_prefix_tokens_to_match * CHARS_PER_TOKEN // blocks_of)
    elif p.max_prefix_blocks_to_match is not None:
        out["maxPrefixBlocksToMatch"] = p.max_prefix_blocks_to_match
    if p.lru_capacity_per_server is not None:
        out["lruCapacityPerServer"] = p.lru_capacity_per_server


class _PrefixScoringParams(_Params):
    match_length_weight: float | None = Field(None, ge=0, le=1)
    match_length_scale_tokens: int | None = Field(None, gt=0)
    prefix_match_info_producer_name: str = ""


def _prefix_scoring(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The reference's prefix-cache-scorer parameters (`matchLengthWeight`: weight of the matched length against
    the matched fraction; `matchLengthScaleTokens`: the length that earns full credit) as ours (`ratioWeight` is
    the fraction's weight, `fullCreditChars` the length). Our own parameters pass through unchanged."""
    reference = {k: params[k] for k in ("matchLengthWeight", "matchLengthScaleTokens", "prefixMatchInfoProducerName")
                 if k in params}
    ours = {k: v for k, v in params.items() if k not in reference}
    p = decode(_PrefixScoringParams, reference, where)
    if p.prefix_match_info_producer_name not in ("", "approx-prefix-cache-producer"):
        raise ConfigError(f"{where}.prefixMatchInfoProducerName: {p.prefix_match_info_producer_name!r}: the "
                          "approximate prefix index is the only producer here")
    for ref_key, our_key in (("matchLengthWeight", "ratioWeight"), ("matchLengthScaleTokens", "fullCreditChars")):
        if ref_key in reference and our_key in ours:
            raise ConfigError(f"{where}.{ref_key}: give it or {our_key}, not both")
    if p.match_length_weight is not None:
        ours["ratioWeight"] = 1.0 - p.match_length_weight
    if p.match_length_scale_tokens is not None:
        ours["fullCreditChars"] = p.match_length_scale_tokens * CHARS_PER_TOKEN
    return ours


def _utilization(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    p = decode(UtilizationParams, params, where)
    return {"queueThreshold": p.queue_depth_threshold, "kvCacheThreshold": p.kv_cache_util_threshold,
            "staleThreshold": f"{p.metrics_staleness_threshold}s"}


def _saturation_detector(data: Mapping[str, Any], declared: Mapping[str, Any], scheduling: dict[str, Any],
                         adapted: Adapted) -> None:
    """`flowControl.saturationDetector.pluginRef` (or the deprecated top-level `saturationDetector`, which in the
    older apiVersion held the thresholds themselves) -> the admission thresholds."""
    flow = data.get("flowControl")
    detector = flow.get("saturationDetector") if isinstance(flow, Mapping) else None
    where = "flowControl.saturationDetector"
    if detector is None and data.get("saturationDetector") is not None:
        detector, where = data["saturationDetector"], "saturationDetector"
    if detector is None:
        return
    if not isinstance(detector, Mapping):
        raise ConfigError(f"{where}: must be a mapping")
    if "pluginRef" not in detector:  # the older form: thresholds inline
        adapted.config["admission"] = _utilization(detector, where)
        return
    ref = detector["pluginRef"]
    if declared.get(ref) != "utilization-detector" and ref != "utilization-detector":
        raise ConfigError(f"{where}.pluginRef: {ref!r} is not a utilization-detector plugin of this config")


def _check_data_layer(layer: Any, declared: Mapping[str, Any]) -> None:
    if layer is None:
        return
    if not isinstance(layer, Mapping):
        raise ConfigError("dataLayer: must be a mapping")
    for key in layer:
        if key not in ("sources", "injectDefaults"):
            raise ConfigError(f"dataLayer.{key}: not supported here (pods come from the InferencePool, "
                              "--endpoint-selector or --endpoints-file)")
    for i, source in enumerate(layer.get("sources") or []):
        ref = source.get("pluginRef") if isinstance(source, Mapping) else None
        if declared.get(str(ref), ref) != "metrics-data-source":
            raise ConfigError(f"dataLayer.sources[{i}].pluginRef: {ref!r}: the pods' Prometheus metrics "
                              "(metrics-data-source) are the only data source here")
        for j, extractor in enumerate(source.get("extractors") or []):
            ref = extractor.get("pluginRef") if isinstance(extractor, Mapping) else None
            if declared.get(str(ref), ref) != "core-metrics-extractor":
                raise ConfigError(f"dataLayer.sources[{i}].extractors[{j}].pluginRef: {ref!r}: "
                                  "core-metrics-extractor (vLLM's metrics) is the only extractor here")


def _check_parsers(handler: Any, parser: Any, declared: Mapping[str, Any]) -> None:
    refs: list[tuple[str, Any]] = []
    if isinstance(handler, Mapping):
        for key in handler:
            if key != "parsers":
                raise ConfigError(f"requestHandler.{key}: not a field (parsers)")
        refs += [(f"requestHandler.parsers[{i}].pluginRef", p.get("pluginRef") if isinstance(p, Mapping) else p)
                 for i, p in enumerate(handler.get("parsers") or [])]
    elif handler is not None:
        raise ConfigError("requestHandler: must be a mapping")
    if isinstance(parser, Mapping):
        refs.append(("parser.pluginRef", parser.get("pluginRef")))
    for where, ref in refs:
        kind = declared.get(str(ref), ref)
        if kind in NOT_IMPLEMENTED:
            raise ConfigError(f"{where}: {ref!r} is not implemented here: {NOT_IMPLEMENTED[kind]}")
        if kind != "openai-parser":
            raise ConfigError(f"{where}: {ref!r} is not a parser of this config (openai-parser)")
