"""The routers of a real-engine run, as a user deploys them: Envoy alone, the picker's strategies behind their Envoy
(NAME@N: N replicas sharing a Valkey), the peers as the proxies they are; and the pickers' own scrape counters."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from picker_lab.bench import peers
from picker_lab.bench.client import SERVED_BY_HEADER
from picker_lab.bench.live import (
    predicted_ttft_config,
    start_direct_envoy,
    start_peer_fleet,
    start_picker_replicas,
)
from picker_lab.bench.peers import PEERS
from picker_lab.bench.real_analysis import HASH_BASELINES
from picker_lab.bench.real_spec import HEALTH_ONLY_INTERVAL, STRATEGIES, RealSpec
from picker_lab.supervisor import HOST, Managed, cpu_seconds


# --- the servers' own counters -------------------------------------------------------------------------------------
def picker_scrapes(metrics_port: int, host: str = HOST) -> dict[str, float]:
    """Scrapes one picker replica made, per pod address (its /metrics)."""
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=10) as resp:
        return scrapes_per_pod(resp.read().decode())


def scrapes_per_pod(text: str) -> dict[str, float]:
    """picker_model_server_scrapes_total of a picker's exposition, per pod, ok and failed together."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "picker_model_server_scrapes_total":
                pod = sample.labels["model_server_pod"]
                out[pod] = out.get(pod, 0.0) + sample.value
    return out


# --- routers -------------------------------------------------------------------------------------------------------
@dataclass
class Router:
    url: str
    processes: list[Managed]
    metrics_ports: list[tuple[str, int]] = field(default_factory=list)  # (host, port) of each picker replica
    # Behind our Envoy: it times each request and names the pod that served it (a peer router is neither)
    through_envoy: bool = True

    def cpu_seconds(self) -> float:
        """User + system CPU time of the router's processes so far."""
        return sum(cpu_seconds(p.proc.pid) for p in self.processes if p.alive())


def picker_flags(strategy: str, spec: RealSpec, logdir: Path) -> list[str]:
    """The `picker serve` flags of a strategy served by the picker (the hash baselines included)."""
    if strategy in HASH_BASELINES:
        flags = ["--strategy", strategy, "--refresh-metrics-interval", HEALTH_ONLY_INTERVAL]
    elif strategy in ("picker", "picker-4-replicas"):
        flags = list(spec.picker_args)
    elif strategy == "picker-predicted-ttft":
        flags = [*spec.picker_args, "--config-file", str(predicted_ttft_config(logdir, 1.0))]
    elif strategy == "picker-round-robin":
        flags = ["--strategy", "round-robin"]  # scraping at the picker's default cadence, as `picker` does
    elif strategy == "picker-candidate":
        flags = [*spec.picker_args, *spec.candidate_args]
    else:
        raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    return ["--log-level", "WARNING", *flags]  # first, so `--picker-args "--log-level DEBUG"` overrides it


def start_router(strategy: str, spec: RealSpec, pool: list[str], logdir: Path,
                 endpoints_file: Path | None = None, timing_log: Path | None = None) -> Router:
    """The router in front of `pool`; the picker strategies follow `endpoints_file` when given. Its Envoy writes
    what it added to each request to `timing_log` (envoyconfig.add_timing_log) when given. `NAME@N` is N replicas
    behind one load balancer (peers.replicated): the picker's behind its Envoy sharing a Valkey, a peer's behind
    an Envoy round-robin (whose timing and pod attribution would be the router's, so it is a peer's as for one)."""
    name, replicas, mesh = peers.replicated(strategy)
    if name == "round-robin":
        direct, url = start_direct_envoy(logdir, pool, served_by=SERVED_BY_HEADER, timing_log=timing_log)
        return Router(url, [direct])
    if name in PEERS:  # (its Envoy in front of several would time and attribute the router, not the pod)
        procs, url, _ = start_peer_fleet(strategy, [f"http://{address}" for address in pool], logdir)
        return Router(url, procs, through_envoy=False)
    if name == "picker-4-replicas":
        replicas = 4
    procs, fleet, _ = start_picker_replicas(logdir, pool, picker_flags(name, spec, logdir), replicas, name,
                                            shared=replicas > 1 and name not in HASH_BASELINES,
                                            served_by=SERVED_BY_HEADER, endpoints_file=endpoints_file,
                                            timing_log=timing_log)
    return Router(fleet.envoy.url, procs, [(p.host, p.metrics_port) for p in fleet.pickers])
