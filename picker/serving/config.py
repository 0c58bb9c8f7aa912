"""Server options: defaults, then `--config-file` (YAML), then command-line flags, in that order of strength.

Decoded strictly (picker.core.schema): an unknown key or a wrong type at the top level or in the `admission`,
`scheduling` and `multimodal` sections is a ConfigError naming the key's path, and `picker serve` exits non-zero with it.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, ValidationError

from picker.core.distribution import install_hint
from picker.core.media import MultimodalConfig
from picker.core.schema import ConfigError, Duration, Section, describe, load_yaml, parse_duration
from picker.endpoints.discovery import load_endpoints_file
from picker.endpoints.scraper import MetricsTarget
from picker.extproc.limits import StreamLimits
from picker.prefix.hashing import IndexKey
from picker.routing.admission import AdmissionConfig
from picker.scheduling import reference
from picker.scheduling.config import SchedulingConfig, StrategyName
from picker.serving import reference_flags
from picker.serving.tls import TLS_VERSIONS, TlsError, TlsOptions

__all__ = ["ConfigError", "ServeConfig", "add_arguments", "parse_duration", "parse_ports", "parse_size", "resolve"]


TEMPLATE_MESSAGE_TIMEOUT = 5.0  # seconds: Envoy's ext_proc message_timeout in our templates (picker envoy-config)


def parse_size(value: str | int) -> int:
    """"16Mi", "1MiB", "512k" or bytes → bytes."""
    if isinstance(value, int):
        return value
    match = re.match(r"^\s*(\d+)\s*([kKmMgG]i?[bB]?)?\s*$", value)
    if not match:
        raise ConfigError(f"{value!r} is not a size (e.g. 16Mi, 512Ki, 1048576)")
    unit = (match.group(2) or "").lower().rstrip("b")
    scale = {"": 1, "k": 1000, "ki": 1024, "m": 10**6, "mi": 2**20, "g": 10**9, "gi": 2**30}[unit]
    return int(match.group(1)) * scale


def parse_ports(text: str) -> list[int]:
    """"8000" or "8000,8001" → ports; ValueError naming the bad one."""
    ports = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or not 0 < int(part) < 65536:
            raise ConfigError(f"{part!r} is not a TCP port")
        ports.append(int(part))
    if not ports:
        raise ConfigError("no ports given")
    return ports


Size = Annotated[int, BeforeValidator(parse_size)]


class ServeConfig(Section):
    """Every `picker serve` option; config-file keys are the flag names (grpc-port or grpc_port)."""

    model_config = ConfigDict(alias_generator=None)

    host: str = "0.0.0.0"
    grpc_host: str = ""  # the ext_proc port's own bind address; empty: --host
    grpc_port: int = Field(9002, ge=0, le=65535)
    grpc_health_port: int = Field(9003, ge=0, le=65535)
    metrics_port: int = Field(9090, ge=-1, le=65535)
    endpoints: str = ""
    endpoints_file: str = ""
    refresh_metrics_interval: Duration | None = Field(None, gt=0)  # fixed scrape cadence; None: adaptive
    metrics_fast_interval: Duration = Field(0.1, gt=0)  # cadence of a pod near saturation or busier than we know
    metrics_slow_interval: Duration = Field(1.0, gt=0)  # cadence of a calm pod
    max_scrapes_per_second: float = Field(500.0, ge=0)  # the pool's scrapes a second at most (intervals stretch); 0: any
    unhealthy_after_failures: int = Field(2, ge=1)
    # data-parallel ranks behind every server's port (vLLM's --data-parallel-size); 0: as each server's metrics
    # label them (engine="0", engine="1"...); 1: never split a server
    data_parallel_ranks: int = Field(0, ge=0, le=1024)
    models_refresh_interval: Duration = Field(30.0, ge=0)  # how often a pod's GET /v1/models is read; 0: never
    # Where pods' metrics are read (the reference picker's flags): scheme, one port for every pod (0: its own), path
    model_server_metrics_scheme: Literal["http", "https"] = "http"
    model_server_metrics_port: int = Field(0, ge=0, le=65535)
    model_server_metrics_path: str = Field("/metrics", pattern=r"^/")
    model_server_metrics_https_insecure_skip_verify: bool = True
    # ask vLLM for only the series the picker reads (a ~3 KB page, not ~50 KB): a scrape costs the pod less
    metrics_only_read_series: bool = True
    max_body_bytes: Size = Field(16 * 2**20, gt=0)
    max_buffered_bytes: Size = Field(256 * 2**20, gt=0)  # request bodies held by all streams together
    stream_idle_timeout: Duration = Field(30.0, gt=0)  # silence before a stream's decision that ends it
    request_timeout: Duration = Field(600.0, gt=0)  # longest a routed request counts in flight (Envoy's route timeout)
    pool_name: str = ""  # empty: "default" as a label; set without static endpoints: discover the InferencePool
    pool_namespace: str = ""  # empty: the picker's own namespace in a cluster, else "default"
    # the InferencePool's API group: v1 (GIE's GA API), or GIE's older alpha one (read as v1alpha2)
    pool_group: Literal["inference.networking.k8s.io", "inference.networking.x-k8s.io"] = "inference.networking.k8s.io"
    fallback_endpoints: int = Field(1, ge=1)
    strategy: StrategyName = "picker"
    seed: int | None = None
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"
    drain_timeout: Duration = Field(2.0, ge=0)  # how long a stopping picker lets open streams finish
    # how long a stopping picker, already NOT_SERVING, still takes new streams while they keep coming: a load
    # balancer's health check needs a few seconds to move away (Envoy's, as we configure it: 2-4 s)
    shutdown_delay: Duration = Field(5.0, ge=0)
    otlp_endpoint: str = ""
    enable_grpc_stream_metrics: bool = False  # llm_d_epp_extproc_* series: streams open, their durations and ends
    metrics_deprecated_names: bool = True  # also export each series under its deprecated GIE name
    index_backend: Literal["memory", "redis"] = "memory"
    redis_url: str = ""
    index_namespace: str = ""
    # With a shared index, replicas also share their in-flight counts this often (0: each counts only its own)
    shared_load_interval: Duration = Field(0.05, ge=0)
    index_hash_key_file: str = ""  # the replicas' shared secret keying what the prefix index stores
    # Precise prefix routing from the pods' KV events (picker.kvevents): where their publishers connect
    kv_events_endpoint: str = Field("", pattern=r"^(tcp://.+:\d+)?$")
    kv_events_port: int = Field(0, ge=0, le=65535)  # or: each pod binds its publisher here, the picker connects
    kv_events_replay_port: int = Field(0, ge=0, le=65535)  # each pod's replay socket (vLLM's replay_endpoint)
    prefix_mode: Literal["approximate", "precise", "auto"] = "auto"
    tokenize_timeout: Duration = Field(0.1, gt=0)  # a pod's POST /tokenize for a prompt's token ids
    tokenizer: str = ""  # a model directory (tokenizer.json + chat template): token ids computed here, not by a pod
    # Kubernetes discovery: an InferencePool (--pool-name with no static endpoints) or a label selector.
    endpoint_selector: str = ""
    endpoint_target_ports: str = ""
    kubeconfig: str = ""
    # TLS on the ext_proc port (picker.serving.tls): on by default, as the reference picker serves it.
    secure_serving: bool = True
    cert_path: str = ""
    enable_cert_reload: bool = False
    client_ca: str = ""
    tls_min_version: str = "VersionTLS12"
    # Policy sections (GIE-like camelCase keys inside).
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    multimodal: MultimodalConfig = Field(default_factory=MultimodalConfig)

    @property
    def pool_label(self) -> str:
        """The pool's name in metrics and in the shared index namespace."""
        return self.pool_name or "default"

    @property
    def metrics_target(self) -> MetricsTarget:
        return MetricsTarget(self.model_server_metrics_scheme, self.model_server_metrics_port,
                             self.model_server_metrics_path, not self.model_server_metrics_https_insecure_skip_verify,
                             self.metrics_only_read_series)

    @property
    def ext_proc_host(self) -> str:
        return self.grpc_host or self.host

    @property
    def index_key(self) -> IndexKey:
        return IndexKey.from_file(self.index_hash_key_file) if self.index_hash_key_file else IndexKey()

    @property
    def stream_limits(self) -> StreamLimits:
        return StreamLimits(self.max_body_bytes, self.max_buffered_bytes, self.stream_idle_timeout,
                            self.request_timeout)

    @property
    def tls(self) -> TlsOptions:
        return TlsOptions(self.secure_serving, self.cert_path, self.enable_cert_reload, self.client_ca,
                          self.tls_min_version)

    @property
    def discovery(self) -> str:
        """Where endpoints come from: "static" (flags, file), "inferencepool" or "selector" (Kubernetes)."""
        if self.endpoint_selector:
            return "selector"
        if self.pool_name and not (self.endpoints or self.endpoints_file):
            return "inferencepool"
        return "static"


_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # TRACE: DEBUG with library internals


def parse_bool(text: str) -> bool:
    """A Go-style boolean flag value (`--secure-serving=false`), as the reference picker's flags take them."""
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "on"):
        return True
    if value in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def load_config_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return load_config_text(text, str(path))


def load_config_text(text: str, source: str) -> dict[str, Any]:
    data = load_yaml(text, source) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a YAML mapping")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags named as GIE's endpoint picker names them, so users can carry their manifests over."""
    a = parser.add_argument
    a("--config-file", help="YAML file with any of these options plus `scheduling`, `admission` and `multimodal` "
      "sections")
    a("--config-text", help="the same YAML given inline, instead of a file (default: none)")
    a("--host", help="address every server binds (default {default})")
    a("--grpc-port", type=int, help="ext_proc + picker.v1 API port (default {default})")
    a("--grpc-host", help="address the ext_proc port alone binds, e.g. 127.0.0.1 for a sidecar whose Envoy is in the "
      "same Pod while probes and Prometheus still reach the others on --host (default: --host)")
    a("--grpc-health-port", type=int, help="gRPC health port (default {default})")
    a("--metrics-port", type=int, help="Prometheus /metrics port (default {default}; 0 picks a free port, -1 disables)")
    a("--endpoints", help="static pool: host:port,host:port, each an IP or a name (a compose service, a headless "
      "Service, localhost) resolved to every IPv4 address it has, again every 5 s")
    a("--endpoints-file", help="YAML/JSON list of endpoints, reloaded when it changes")
    a("--refresh-metrics-interval", help="scrape every endpoint's /metrics at this fixed cadence (e.g. 50ms); "
      "default: adaptive, see --metrics-fast-interval and --metrics-slow-interval")
    a("--metrics-fast-interval", help="adaptive scraping: cadence of a pod near saturation, running requests we "
      "did not route, or failing (default {default})")
    a("--metrics-slow-interval", help="adaptive scraping: cadence of a calm pod (default {default})")
    a("--max-scrapes-per-second", type=float, help="scrapes of the pool's /metrics a second at most: when the pods' "
      "cadences ask for more (a large pool, many pods busy), every interval stretches by the same factor "
      "(picker_model_server_scrape_stretch); default {default} (a calm pod's 1 s up to 500 pods), 0: no cap")
    a("--model-server-metrics-scheme", choices=("http", "https"), help="how pods' metrics are read (default {default})")
    a("--model-server-metrics-port", type=int,
      help="the port every pod serves metrics on (default: each pod's own serving port)")
    a("--model-server-metrics-path", help="where pods serve metrics (default {default})")
    a("--model-server-metrics-https-insecure-skip-verify", type=parse_bool, nargs="?", const=True, metavar="BOOL",
      help="with https, accept the pods' certificates unverified (default {default}, as the reference picker)")
    a("--metrics-only-read-series", type=parse_bool, nargs="?", const=True, metavar="BOOL",
      help="ask each pod for only the vLLM series the picker reads (name[] at <path>/, ~3 KB instead of ~50 KB); a "
      "pod whose page does not take the filter is read whole (default {default})")
    a("--unhealthy-after-failures", type=int, help="failed scrapes before a pod's serving port is tried: degraded "
      "(still routed) if it answers, unready if not (2)")
    a("--data-parallel-ranks", type=int, help="data-parallel ranks behind every model server's port (vLLM's "
      "--data-parallel-size): each routed as a target of its own, the pick named in x-data-parallel-rank (default "
      "{default}: as each server's metrics label their engines; 1: route every server as one)")
    a("--models-refresh-interval", help="how often each pod's GET /v1/models is read to learn its loaded LoRA "
      "adapters, idle ones too (default {default}; 0s: never, the pods' metrics alone tell what they serve)")
    a("--max-body-bytes", help="largest request body accepted (default {default}); larger gets 413")
    a("--max-buffered-bytes", help="request-body bytes all streams together may hold while they arrive (default "
      "{default}); beyond it a body gets 503 buffers_full with retry-after")
    a("--stream-idle-timeout", help="an ext_proc stream silent this long before its decision is ended (default {default})")
    a("--request-timeout", help="longest a routed request counts in flight on its pod, should its stream stay open "
      "(default {default}: Envoy's route timeout in our templates)")
    a("--pool-name", help="InferencePool to discover pods from (Kubernetes; without --endpoints/--endpoints-file), "
      "also the metrics label")
    a("--pool-group", help="API group of the InferencePool: inference.networking.k8s.io (v1, default) or GIE's older "
      "inference.networking.x-k8s.io (v1alpha2)")
    a("--pool-namespace", help="namespace of the InferencePool or of the selected pods (default: the picker's own)")
    a("--endpoint-selector", help="discover pods by label selector instead of an InferencePool, e.g. app=vllm")
    a("--endpoint-target-ports", help="with --endpoint-selector: the model server ports, e.g. 8000 or 8000,8001")
    a("--kubeconfig", help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG)")
    a("--fallback-endpoints", type=int, help="ranked endpoints to return, comma-separated (default {default}; Envoy's "
      "ORIGINAL_DST accepts only 1, lists are for gateways that implement GIE fallbacks)")
    a("--strategy", help="picker (default: prefix- and load-aware), round-robin, random, least-load, prefix-only, "
      "prefix-hash (hash of the prompt's first 1,000 characters: a baseline that reads no metrics), hash-ring "
      "(the same characters on a consistent-hash ring, 200 points per pod), bounded-load (that ring with bounded "
      "loads: a pod past 1.25x the mean in-flight passes the key on), text-tree (SGLang router's cache_aware "
      "policy: the pod sent the longest shared prefix, else the one sent the least text)")
    a("--seed", type=int, help="seed for random tie-breaks and weighted model rewrites (reproducible runs)")
    a("--log-level", type=str.upper, choices=_LOG_LEVELS, metavar="LEVEL",
      help=f"{', '.join(_LOG_LEVELS)} (default {{default}}; any case). DEBUG: one line per routing decision; TRACE: "
      "also the libraries' own debug lines (gRPC, asyncio, HTTP)")
    a("--log-format", choices=("text", "json"), help="text lines, or one JSON object per line (default {default})")
    a("--drain-timeout", help="how long a stopping picker lets open streams finish (default {default})")
    a("--shutdown-delay", help="how long at most a picker stopped by SIGTERM, reporting NOT_SERVING, still takes "
      "new streams: until every host that health-checks it has heard NOT_SERVING and none came for 0.25 s after, "
      "so a rolling restart sends none to the fail-open route (default {default}; 0: refuse new streams at once; "
      "SIGINT: at once)")
    a("--enable-grpc-stream-metrics", type=parse_bool, nargs="?", const=True, metavar="BOOL",
      help="export the ext_proc streams open, their durations and how they ended (llm_d_epp_extproc_*, as the "
      "reference picker's flag; default {default})")
    a("--metrics-deprecated-names", type=parse_bool, nargs="?", const=True, metavar="BOOL",
      help="also export every series under its deprecated GIE name (inference_objective_*, inference_pool_*, "
      "inference_extension_*), as the reference picker does; false: only the current llm_d_epp_* names "
      "(default {default})")
    a("--otlp-endpoint", help="OTLP/HTTP collector for traces (e.g. http://127.0.0.1:4318); empty disables")
    a("--index-backend", choices=("memory", "redis"),
      help="prefix index: memory (one replica) or redis (shared by every replica through --redis-url)")
    a("--redis-url", help="Redis/Valkey for --index-backend redis, e.g. redis://127.0.0.1:6379/0")
    a("--index-namespace", help="replicas with the same namespace share one index (default: pool namespace/name)")
    a("--shared-load-interval", help="with --index-backend redis: how often the replicas share their in-flight "
      "requests per pod through Redis, so flow control admits on the whole fleet's load (default {default}; 0: each "
      "counts only its own)")
    a("--kv-events-endpoint", metavar="tcp://HOST:PORT",
      help="precise prefix routing: bind here for the pods' vLLM KV events (their --kv-events-config endpoint, "
      "topic kv@<pod ip>:<port>@<model>; data-parallel rank r publishes on PORT + r, bound too for the ranks the "
      "pool has); default: none, the approximate index alone")
    a("--kv-events-port", type=int, help="precise prefix routing, the other way round: every pod's vLLM binds its "
      "KV-event publisher on this port (endpoint tcp://*:PORT; data-parallel rank r on PORT + r) and the picker "
      "connects to each pod of its pool; every replica can (default {default}: not this way)")
    a("--kv-events-replay-port", type=int, help="the port of every pod's KV-event replay socket (vLLM's "
      "replay_endpoint; data-parallel rank r's on PORT + r), asked for missed events (default {default}: none; a "
      "gap then resets that pod's view)")
    a("--prefix-mode", choices=("approximate", "precise", "auto"),
      help="with --kv-events-endpoint: auto (default) scores pods whose events flow from them and the rest from "
      "the approximate index; precise trusts the events alone; approximate ignores them")
    a("--tokenizer", metavar="DIR", help="with --kv-events-endpoint: the model's directory (tokenizer.json and "
      "its chat template, in tokenizer_config.json or chat_template.jinja) to compute prompts' token ids here, "
      "as vLLM does (the tokenizer extra); default: ask a pod's POST /tokenize")
    a("--tokenize-timeout", help="the longest a pod's POST /tokenize may take for a prompt's token ids "
      "(default {default}; slower: the request is routed on the approximate index)")
    a("--index-hash-key-file", help="file holding a secret (16+ bytes) shared by the replicas: prefix hashes and "
      "session ids in Redis are keyed with it, so reading Redis confirms no guessed prompt (default: unkeyed, "
      "with a warning when the index is shared)")
    a("--secure-serving", type=parse_bool, nargs="?", const=True, metavar="BOOL",
      help="serve ext_proc and picker.v1 over TLS (default {default}, as the reference picker; --secure-serving=false "
      "for plaintext, e.g. a sidecar on loopback). The health port is always plaintext")
    a("--cert-path", help="directory holding tls.crt and tls.key (a mounted kubernetes.io/tls Secret); default: a "
      "self-signed pair made at start")
    a("--enable-cert-reload", type=parse_bool, nargs="?", const=True, metavar="BOOL",
      help="re-read --cert-path when its files change (default {default})")
    a("--client-ca", help="PEM CA file: require every client (Envoy) to present a certificate it signed (mTLS)")
    a("--tls-min-version", help=f"{', '.join(TLS_VERSIONS)} (default {{default}}; TLS 1.2 is grpcio's floor "
      "already, VersionTLS13 is refused as it cannot be enforced)")
    for action in parser._actions:  # "{default}" in a flag's help: its ServeConfig default, written only there
        if action.help and "{default}" in action.help:
            action.help = action.help.replace("{default}", default_text(action.dest))
    reference_flags.add_arguments(parser)


def default_text(name: str) -> str:
    """A ServeConfig field's default as one would write it on the command line (2s, 100ms, 16Mi, true)."""
    field = ServeConfig.model_fields[name]
    value = field.default
    parsers = {m.func for m in field.metadata if isinstance(m, BeforeValidator)}
    if parse_duration in parsers:
        return f"{value * 1000:g}ms" if 0 < value < 1 else f"{value:g}s"
    if parse_size in parsers:
        for unit, scale in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
            if value and value % scale == 0:
                return f"{value // scale}{unit}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def decode_serve_config(data: Mapping[str, Any], source: str = "") -> ServeConfig:
    """Options keyed by flag name (dashes or underscores) as a ServeConfig; ConfigError names the bad key as
    it was spelled."""
    spelled = {str(key).replace("-", "_"): str(key) for key in data}
    try:
        return ServeConfig.model_validate({name: data[key] for name, key in spelled.items()})
    except ValidationError as exc:
        problems = describe(exc, "", spelled, ServeConfig)
        raise ConfigError(f"{source}: {problems}" if source else problems) from None


def adapt_reference_config(data: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """The reference picker's EndpointPickerConfig (the whole file), or its plugin vocabulary inside our
    `scheduling:` section, in our layout (picker.scheduling.reference); plus warnings for what changes nothing."""
    try:
        if reference.is_endpoint_picker_config(data):
            adapted = reference.adapt_document(data)
            return adapted.config, adapted.warnings
        if not isinstance(data.get("scheduling"), Mapping):
            return data, []
        adapted = reference.adapt_section(data["scheduling"])
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    merged = {**data, "scheduling": adapted.config.pop("scheduling")}
    implied_admission = adapted.config.pop("admission", {})
    if implied_admission:
        given = merged.get("admission") or {}
        merged["admission"] = {**implied_admission, **given} if isinstance(given, Mapping) else given
    for key, value in adapted.config.items():  # serve options a plugin implies: the file's own keys win
        if key not in merged and key.replace("-", "_") not in merged:
            merged[key] = value
    return merged, adapted.warnings


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def scheduling_source(args: argparse.Namespace) -> str:
    """Where the `scheduling` section came from (no flag sets it), for errors the scheduler's build finds."""
    given = vars(args)
    return str(given.get("config_file") or ("--config-text" if given.get("config_text") else ""))


def resolve(args: argparse.Namespace, notes: list[str] | None = None) -> ServeConfig:
    """Merge defaults, the config file and explicit flags; ConfigError naming the offending option (the plugin
    graph is checked where it is built, `PickerServer`, before any port opens). Warnings
    about settings that change nothing here (from a reference picker's config) are appended to `notes`."""
    given = vars(args)
    config_file, config_text = given.get("config_file"), given.get("config_text")
    if config_file and config_text:
        raise ConfigError("give --config-file or --config-text, not both")
    data: dict[str, Any] = dict(load_config_file(config_file)) if config_file else {}
    if config_text:
        data = load_config_text(config_text, "--config-text")
    data, warnings = adapt_reference_config(data, config_file or "--config-text")
    if notes is not None:
        notes.extend(warnings)
    if data:  # the file is checked whole, before flags override some of its keys: a wrong value is never hidden
        decode_serve_config(dict(data), config_file or "--config-text")
    try:  # the reference picker's flags (-v, --zap-*): ours, when both are given, win
        flags: dict[str, Any] = reference_flags.options(reference_flags.given(args))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    flags.update({name.replace("_", "-"): value for name, value in given.items()
                  if value is not None and name in ServeConfig.model_fields
                  and name not in ("scheduling", "admission")})
    for key in [k for k in data if str(k).replace("-", "_") in {f.replace("-", "_") for f in flags}]:
        del data[key]  # a flag beats the file's value, however the file spelled the key
    data.update(flags)
    source = " + ".join(filter(None, (config_file, "--config-text" if config_text else "",
                                      "command line" if flags else "")))
    config = decode_serve_config(data, source)
    if config.discovery == "static" and not (config.endpoints or config.endpoints_file):
        raise ConfigError("no endpoint source: give --endpoints, --endpoints-file, --pool-name (an InferencePool, in "
                         "Kubernetes) or --endpoint-selector")
    if config.endpoints_file and not Path(config.endpoints_file).is_file():
        raise ConfigError(f"--endpoints-file {config.endpoints_file}: no such file (it is read at start-up, then "
                          "watched for changes)")
    if config.endpoints_file:  # wrong at start-up is as fatal as missing: a later bad edit keeps the last good set
        try:
            load_endpoints_file(Path(config.endpoints_file))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--endpoints-file {exc}") from None
    if config.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError(f"log-level {config.log_level!r} is not one of {', '.join(_LOG_LEVELS)}")
    if config.endpoint_selector and (config.endpoints or config.endpoints_file):
        raise ConfigError("--endpoint-selector discovers pods itself: drop --endpoints/--endpoints-file")
    if config.endpoint_selector and not config.endpoint_target_ports:
        raise ConfigError("--endpoint-selector needs --endpoint-target-ports (e.g. 8000)")
    if config.endpoint_target_ports:
        parse_ports(config.endpoint_target_ports)
    if config.max_buffered_bytes < config.max_body_bytes:
        raise ConfigError("max-buffered-bytes must hold at least one body of max-body-bytes")
    if config.metrics_fast_interval > config.metrics_slow_interval:
        raise ConfigError("metrics-fast-interval must not exceed metrics-slow-interval")
    try:
        config.tls.check()
    except TlsError as exc:
        raise ConfigError(str(exc)) from None
    if config.tokenizer:
        from picker.prefix.tokens import LocalTokenizer, TokenizerFilesError
        try:
            LocalTokenizer(config.tokenizer)
        except TokenizerFilesError as exc:
            raise ConfigError(f"tokenizer: {exc}") from None
    if config.kv_events_endpoint and config.kv_events_port:
        raise ConfigError("kv-events-port: give --kv-events-endpoint (the pods connect to the picker) or "
                          "--kv-events-port (the picker connects to the pods), not both")
    if (config.kv_events_endpoint or config.kv_events_port) and not _importable("zmq"):
        key = "kv-events-endpoint" if config.kv_events_endpoint else "kv-events-port"
        raise ConfigError(f"{key}: reading KV events needs pyzmq; install it with: {install_hint('kv-events')}")
    if config.index_hash_key_file:
        try:
            IndexKey.from_file(config.index_hash_key_file)
        except ValueError as exc:
            raise ConfigError(f"--index-hash-key-file {exc}") from None
    fc = config.admission.flow_control
    if fc.enabled and fc.queue_ttl >= TEMPLATE_MESSAGE_TIMEOUT and notes is not None:
        notes.append(f"admission.flowControl.queueTtl {fc.queue_ttl:g}s is not below the {TEMPLATE_MESSAGE_TIMEOUT:g}s "
                     "ext_proc message_timeout of our Envoy templates: render Envoy with a longer one "
                     "(picker envoy-config --message-timeout, --queue-ttl) or queued requests fail open")
    if fc.enabled and fc.critical_slot_share and not fc.max_running_per_pod and notes is not None:
        notes.append("admission.flowControl.criticalSlotShare without maxRunningPerPod: the pods' capacities are "
                     "learned from their queues, which can take a partly used pod for full; give maxRunningPerPod "
                     "(the pods' --max-num-seqs)")
    if config.index_backend == "redis" and not config.redis_url:
        raise ConfigError("--index-backend redis needs --redis-url (e.g. redis://127.0.0.1:6379/0)")
    return config
