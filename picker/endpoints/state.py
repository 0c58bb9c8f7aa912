"""Per-endpoint state shared by discovery, metrics scraping, the scheduler and the ext_proc servicer."""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass, field

from picker.endpoints.load_column import LoadColumn

RANK_MARK = "#"  # between a server's address and a rank's index in the rank's identity
DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_host_port(text: str) -> tuple[str, int]:
    """"ip:port", "[v6]:port" or "dns-name:port" (a model server reached by name, as in docker-compose or a headless
    Service); ValueError with the valid forms otherwise."""
    text = text.strip()
    try:
        return parse_address(text)
    except ValueError as exc:
        host, sep, port_text = text.rpartition(":")
        if not (sep and host and DNS_NAME.match(host) and not host.replace(".", "").isdigit()):
            raise ValueError(f"{exc} nor a host name with a port (e.g. 10.0.0.5:8000 or vllm-0.vllm:8000)") from None
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"endpoint {text!r}: bad port {port_text!r}") from None
        return host, int(port_text)


def parse_address(text: str) -> tuple[str, int]:
    """Split and validate "ip:port" ("[v6]:port" for IPv6); ValueError with a readable reason otherwise."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint {text!r} is not ip:port")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"endpoint {text!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"endpoint {text!r}: bad port {port_text!r}")
    return host, int(port_text)


@dataclass(slots=True)
class EndpointMetrics:
    """What a vLLM pod reports on /metrics; `updated_at` is the picker clock at the scrape."""

    waiting: float = 0.0  # vllm:num_requests_waiting
    running: float = 0.0  # vllm:num_requests_running
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    block_size: int | None = None  # vllm:cache_config_info{block_size}
    num_gpu_blocks: int | None = None  # vllm:cache_config_info{num_gpu_blocks}
    prefix_queries: float = 0.0  # vllm:prefix_cache_queries_total (tokens)
    prefix_hits: float = 0.0  # vllm:prefix_cache_hits_total (tokens)
    prefill_tokens: float = 0.0  # vllm:request_prefill_kv_computed_tokens_sum (tokens prefilled, finished requests)
    prefill_seconds: float = 0.0  # vllm:request_prefill_time_seconds_sum (their time in the prefill phase)
    prefill_count: float = 0.0  # vllm:request_prefill_time_seconds_count (how many requests those are)
    ttft_seconds: float = 0.0  # vllm:time_to_first_token_seconds_sum (the pod's own view of TTFT)
    ttft_count: float = 0.0  # vllm:time_to_first_token_seconds_count
    prompt_tokens: float = 0.0  # vllm:request_prompt_tokens_sum (prompt tokens of finished requests)
    prompt_count: float = 0.0  # vllm:request_prompt_tokens_count (how many requests those are)
    max_lora: int = 0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()  # the `model_name` label of its series: the base model(s) it serves
    updated_at: float = -1.0  # never scraped
    # A page of several engines (vLLM's data-parallel ranks, label `engine`): each engine's own series, by its
    # index; the fields above are then their sum (KV use their mean). None: one engine, or no engine label.
    engines: dict[int, EndpointMetrics] | None = None


class EndpointState(enum.Enum):
    READY = "ready"  # routed to, on fresh metrics
    DEGRADED = "degraded"  # routed to on our own view: its metrics cannot be read, its serving port answers
    UNREADY = "unready"  # not routed to: it cannot be reached


@dataclass(slots=True, eq=False)
class Endpoint:
    """One model-server pod, or one data-parallel rank of it. Identity is its address: "ip:port" for a server,
    "ip:port#rank" for a rank (a `#` is in no IP, host name or port, so the two never collide). The same object
    lives as long as the pod (the rank)."""

    address: str
    ip: str
    port: int
    name: str = ""  # pod name when known (Kubernetes discovery), else the address
    labels: dict[str, str] = field(default_factory=dict)  # the pod's labels (Kubernetes, endpoints file)
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    state: EndpointState = EndpointState.READY  # changed by the pool only (EndpointPool.mark_*)
    # Our own view, updated from the ext_proc stream lifecycle because scraped metrics lag: what routing reads.
    in_flight: int = 0
    in_flight_tokens: int = 0
    # What the other replicas have in flight here, when they share their load (picker.endpoints.shared_load): their
    # last reports plus the picks heard since. Admission reads the fleet's count (`fleet_in_flight`).
    peer_in_flight: int = 0
    peer_in_flight_tokens: int = 0
    finished: int = 0  # requests we sent it that have ended, ever (what ended since a scrape: its count then)
    last_picked_at: float = -1.0
    consecutive_failures: int = 0
    scrape_interval: float = 0.0  # seconds until the scraper refreshes `metrics` again (its current cadence)
    listed_models: frozenset[str] = frozenset()  # what its GET /v1/models listed: base models, loaded adapters
    listed_for: frozenset[str] = frozenset()  # the base models its metrics named when that listing was read
    # The pool's column of ready pods' counts this pod writes its own into (picker.endpoints.load_column), and its row
    column: LoadColumn | None = field(default=None, repr=False, compare=False)
    row: int = field(default=0, repr=False, compare=False)
    # A data-parallel rank: its index (what `x-data-parallel-rank` carries) and the server it runs in, which is
    # scraped, health-checked and routed to for it (picker.endpoints.pool). -1 and None: a whole server.
    rank: int = -1
    server: Endpoint | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_address(cls, address: str, name: str = "", labels: dict[str, str] | None = None) -> Endpoint:
        ip, port = parse_address(address)
        canonical = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        return cls(address=canonical, ip=ip, port=port, name=name or canonical, labels=labels or {})

    @classmethod
    def rank_of(cls, server: Endpoint, rank: int) -> Endpoint:
        """Rank `rank` of `server`: its own identity, counts and metrics; the server's address, name and labels."""
        return cls(address=f"{server.address}{RANK_MARK}{rank}", ip=server.ip, port=server.port,
                   name=f"{server.name}{RANK_MARK}{rank}", labels=server.labels, state=server.state, rank=rank,
                   server=server)

    @property
    def destination(self) -> str:
        """The "ip:port" Envoy sends its requests to: its server's for a rank."""
        return self.address if self.server is None else self.server.address

    @property
    def healthy(self) -> bool:
        """Routable: ready or degraded."""
        return self.state is not EndpointState.UNREADY

    def metrics_age(self, now: float) -> float:
        """Seconds since the last successful scrape (infinite when never scraped)."""
        return float("inf") if self.metrics.updated_at < 0 else now - self.metrics.updated_at

    def metrics_overdue(self, now: float) -> float:
        """Seconds the metrics are older than the scraper's cadence promises (<= 0: current)."""
        return self.metrics_age(now) - self.scrape_interval

    def listing(self) -> frozenset[str]:
        """What its /v1/models listed, while its metrics still name the base models they named then: a pod that
        has swapped its model is not taken at its old word (the listing is read again)."""
        return self.listed_models if self.listed_for == self.metrics.models else frozenset()

    def start_request(self, tokens: int, now: float) -> None:
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self.last_picked_at = now
        if self.column is not None:
            self.column.update(self)
        if self.server is not None:  # the scraper compares the server's page with what we sent it in all
            self.server.start_request(tokens, now)

    def finish_request(self, tokens: int) -> None:
        self.finished += 1
        self.in_flight = max(0, self.in_flight - 1)
        self.in_flight_tokens = max(0, self.in_flight_tokens - tokens)
        if self.column is not None:
            self.column.update(self)
        if self.server is not None:
            self.server.finish_request(tokens)

    @property
    def fleet_in_flight(self) -> int:
        """Requests in flight here from every replica: ours, and the others' as last heard."""
        return self.in_flight + self.peer_in_flight

    def peer_started(self, prompt_tokens: float) -> None:
        """Another replica routed a request here (its pick, heard through the shared index, carries its prompt's
        length): counted until the next load sync replaces the peers' counts with their reports."""
        self.peer_in_flight += 1
        self.peer_in_flight_tokens += int(prompt_tokens)

    def set_peer_load(self, requests: int, tokens: int) -> None:
        """What the other replicas last reported in flight here (0, 0: none, or they cannot be heard)."""
        self.peer_in_flight = requests
        self.peer_in_flight_tokens = tokens
