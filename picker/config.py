"""Server options: defaults, then `--config-file` (YAML), then command-line flags, in that order of strength."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: str | float | int) -> float:
    """"50ms", "0.5s", "2m" or a number of seconds → seconds (GIE-style flag values)."""
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a duration (e.g. 50ms, 0.5s, 2m)")
    if match.group(2) is None and float(match.group(1)) != 0:
        # as Go's time.ParseDuration (GIE's flags): "50" could mean 50 ms or 50 s, so it needs its unit
        raise ValueError(f"{value!r} needs a unit: {value.strip()}ms or {value.strip()}s")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_size(value: str | int) -> int:
    """"16Mi", "1MiB", "512k" or bytes → bytes."""
    if isinstance(value, int):
        return value
    match = re.match(r"^\s*(\d+)\s*([kKmMgG]i?[bB]?)?\s*$", value)
    if not match:
        raise ValueError(f"{value!r} is not a size (e.g. 16Mi, 512Ki, 1048576)")
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
            raise ValueError(f"{part!r} is not a TCP port")
        ports.append(int(part))
    if not ports:
        raise ValueError("no ports given")
    return ports


@dataclass(slots=True)
class ServeConfig:
    host: str = "0.0.0.0"
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    endpoints: str = ""
    endpoints_file: str = ""
    refresh_metrics_interval: float | None = None  # fixed scrape cadence; None: adaptive (the two below)
    metrics_fast_interval: float = 0.1  # scrape cadence of a pod near saturation or busier than we know
    metrics_slow_interval: float = 1.0  # scrape cadence of a calm pod
    unhealthy_after_failures: int = 2
    max_body_bytes: int = 16 * 2**20
    pool_name: str = ""  # empty: "default" as a label; set without static endpoints: discover the InferencePool
    pool_namespace: str = ""  # empty: the picker's own namespace in a cluster, else "default"
    fallback_endpoints: int = 1
    strategy: str = "picker"
    seed: int | None = None
    log_level: str = "INFO"
    otlp_endpoint: str = ""
    index_backend: str = "memory"
    redis_url: str = ""
    index_namespace: str = ""
    # Kubernetes discovery: an InferencePool (--pool-name with no static endpoints) or a label selector.
    endpoint_selector: str = ""
    endpoint_target_ports: str = ""
    kubeconfig: str = ""
    # Policy sections passed through to the scheduler and admission builders (GIE-like names).
    scheduling: dict[str, Any] = field(default_factory=dict)
    admission: dict[str, Any] = field(default_factory=dict)

    @property
    def pool_label(self) -> str:
        """The pool's name in metrics and in the shared index namespace."""
        return self.pool_name or "default"

    @property
    def discovery(self) -> str:
        """Where endpoints come from: "static" (flags, file), "inferencepool" or "selector" (Kubernetes)."""
        if self.endpoint_selector:
            return "selector"
        if self.pool_name and not (self.endpoints or self.endpoints_file):
            return "inferencepool"
        return "static"


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_CONVERTERS: dict[str, Any] = {
    "refresh_metrics_interval": parse_duration,
    "metrics_fast_interval": parse_duration,
    "metrics_slow_interval": parse_duration,
    "max_body_bytes": parse_size,
}


def _apply(config: ServeConfig, key: str, value: Any, source: str) -> None:
    name = key.replace("-", "_")
    known = {f.name for f in fields(ServeConfig)}
    if name not in known:
        raise ValueError(f"{source}: unknown option {key!r}")
    if name in _CONVERTERS:
        value = _CONVERTERS[name](value)
    setattr(config, name, value)


def load_config_file(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must be a YAML mapping")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags named as GIE's endpoint picker names them, so users can carry their manifests over."""
    a = parser.add_argument
    a("--config-file", help="YAML file with any of these options plus `scheduling` and `admission` sections")
    a("--host", help="address every server binds (default 0.0.0.0)")
    a("--grpc-port", type=int, help="ext_proc + picker.v1 API port (default 9002)")
    a("--grpc-health-port", type=int, help="gRPC health port (default 9003)")
    a("--metrics-port", type=int, help="Prometheus /metrics port (default 9090; 0 picks a free port, -1 disables)")
    a("--endpoints", help="static pool: ip:port,ip:port")
    a("--endpoints-file", help="YAML/JSON list of endpoints, reloaded when it changes")
    a("--refresh-metrics-interval", help="scrape every endpoint's /metrics at this fixed cadence (e.g. 50ms); "
      "default: adaptive, see --metrics-fast-interval and --metrics-slow-interval")
    a("--metrics-fast-interval", help="adaptive scraping: cadence of a pod near saturation, running requests we "
      "did not route, or failing (default 100ms)")
    a("--metrics-slow-interval", help="adaptive scraping: cadence of a calm pod (default 1s)")
    a("--unhealthy-after-failures", type=int, help="failed scrapes before an endpoint stops being picked (2)")
    a("--max-body-bytes", help="largest request body accepted (default 16Mi); larger gets 413")
    a("--pool-name", help="InferencePool to discover pods from (Kubernetes; without --endpoints/--endpoints-file), "
      "also the metrics label")
    a("--pool-namespace", help="namespace of the InferencePool or of the selected pods (default: the picker's own)")
    a("--endpoint-selector", help="discover pods by label selector instead of an InferencePool, e.g. app=vllm")
    a("--endpoint-target-ports", help="with --endpoint-selector: the model server ports, e.g. 8000 or 8000,8001")
    a("--kubeconfig", help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG)")
    a("--fallback-endpoints", type=int, help="ranked endpoints to return, comma-separated (default 1; Envoy's "
      "ORIGINAL_DST accepts only 1, lists are for gateways that implement GIE fallbacks)")
    a("--strategy", help="picker (default: prefix- and load-aware), round-robin, random, least-load, prefix-only, "
      "prefix-hash (hash of the prompt's first 1,000 characters: a baseline that reads no metrics)")
    a("--seed", type=int, help="seed for random tie-breaks (reproducible runs)")
    a("--log-level", help="DEBUG, INFO, WARNING, ERROR")
    a("--otlp-endpoint", help="OTLP/HTTP collector for traces (e.g. http://127.0.0.1:4318); empty disables")
    a("--index-backend", choices=("memory", "redis"),
      help="prefix index: memory (one replica) or redis (shared by every replica through --redis-url)")
    a("--redis-url", help="Redis/Valkey for --index-backend redis, e.g. redis://127.0.0.1:6379/0")
    a("--index-namespace", help="replicas with the same namespace share one index (default: pool namespace/name)")


def resolve(args: argparse.Namespace) -> ServeConfig:
    """Merge defaults, the config file and explicit flags; ValueError with the offending option."""
    config = ServeConfig()
    if getattr(args, "config_file", None):
        for key, value in load_config_file(args.config_file).items():
            _apply(config, key, value, args.config_file)
    for f in fields(ServeConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ("scheduling", "admission"):
            _apply(config, f.name, value, "command line")
    if config.discovery == "static" and not (config.endpoints or config.endpoints_file):
        raise ValueError("no endpoint source: give --endpoints, --endpoints-file, --pool-name (an InferencePool, in "
                         "Kubernetes) or --endpoint-selector")
    if config.log_level.upper() not in _LOG_LEVELS:
        raise ValueError(f"log-level {config.log_level!r} is not one of {', '.join(_LOG_LEVELS)}")
    if config.endpoint_selector and (config.endpoints or config.endpoints_file):
        raise ValueError("--endpoint-selector discovers pods itself: drop --endpoints/--endpoints-file")
    if config.endpoint_selector and not config.endpoint_target_ports:
        raise ValueError("--endpoint-selector needs --endpoint-target-ports (e.g. 8000)")
    if config.endpoint_target_ports:
        parse_ports(config.endpoint_target_ports)
    for name in ("refresh_metrics_interval", "metrics_fast_interval", "metrics_slow_interval"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name.replace('_', '-')} must be positive")
    if config.metrics_fast_interval > config.metrics_slow_interval:
        raise ValueError("metrics-fast-interval must not exceed metrics-slow-interval")
    if config.index_backend not in ("memory", "redis"):
        raise ValueError(f"index_backend must be memory or redis, not {config.index_backend!r}")
    if config.index_backend == "redis" and not config.redis_url:
        raise ValueError("--index-backend redis needs --redis-url (e.g. redis://127.0.0.1:6379/0)")
    return config
