"""`picker serve`: ext_proc + picker.v1 API on --grpc-port, gRPC health on --grpc-health-port, Prometheus on
--metrics-port, endpoint discovery and metrics scraping in the background."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as extproc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from picker.api.service import PickerService, picker_pb2_grpc
from picker.core.lifecycle import cancel_all
from picker.core.logformat import configure_logging, exit_line
from picker.core.model_rewrite import ModelRewrites, configured_rules
from picker.endpoints.discovery import EndpointsFileWatcher, StaticEndpoints, parse_endpoint_list
from picker.endpoints.kubernetes import (
    KubeApi,
    KubernetesDiscovery,
    load_kube_config,
    watch_model_rewrites,
    watch_objectives,
)
from picker.endpoints.model_listing import ModelListings
from picker.endpoints.model_serving import ModelServing
from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.extproc.servicer import ExtProcServicer
from picker.prefix.tokens import LocalTokenizer, PodTokenizer, PromptTokenizer
from picker.routing import plugins as request_plugins
from picker.routing.director import Director
from picker.routing.lifecycle import PluginDeps
from picker.serving import config as cfg
from picker.serving import reference_flags
from picker.serving.handshakes import HandshakeWatch
from picker.serving.health import CheckedHealth
from picker.serving.kv_events import start_kv_events
from picker.serving.metrics import PickerMetrics
from picker.serving.metrics.tracing import DecisionTracer
from picker.serving.policy import (
    build_gate,
    build_policy,
    scrape_listener,
    shared_load,
    start_monitor,
)
from picker.serving.tls import certificate_hosts, server_credentials

log = logging.getLogger("picker")
# A stopping picker stops taking streams once none has come for this long after its health checkers heard
# NOT_SERVING: what they had already routed here has arrived.
QUIET_BEFORE_STOP = 0.25

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXTPROC_SERVICE)
# Until Kubernetes discovery has listed the pods once, and whenever the pool is empty, the picker is alive but not
# ready: Kubernetes keeps it out of its Service and Envoy's health check sends requests to another replica or down
# the fail-open route instead of to a picker with no endpoints.
READY_SERVICES = ("readiness", EXTPROC_SERVICE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser)


class BindError(OSError):
    """A port `picker serve` cannot listen on, named by its flag: the user's one-line error, exit code 2."""

    def __init__(self, flag: str, value: object, reason: str) -> None:
        super().__init__(f"{flag} {value}: {reason}")


def _check_port_free(host: str, port: int, flag: str) -> None:
    """Try the bind gRPC is about to make, so a taken port gets the OS's reason instead of grpc's log line.

    SO_REUSEADDR as gRPC sets it: a port left in TIME_WAIT by the last run is free, a listening one is not.
    Port 0 is probed too: it still tells an unknown --host.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise BindError("--host", host, str(exc.strerror or exc).lower()) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise BindError(flag, port, _reason(exc)) from None


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def _bind_grpc(server: grpc.aio.Server, host: str, port: int, flag: str,
               credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `server` to host:port (TLS with `credentials`) and return the port; BindError naming `flag` when it
    cannot be had."""
    _check_port_free(host, port, flag)
    try:
        address = f"{host}:{port}"
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # recent grpcio raises "Failed to bind"; older versions return 0
        bound = 0
    if bound == 0:
        raise BindError(flag, port, f"cannot listen on {host}:{port}")
    return bound


@dataclass
class PickerServer:
    """Everything `picker serve` runs, startable in-process (tests, demo) and stoppable cleanly."""

    config: cfg.ServeConfig
    pool: EndpointPool = field(default_factory=EndpointPool)
    grpc_port: int = 0
    health_port: int = 0
    metrics_port: int = 0

    def __post_init__(self) -> None:
        """The metrics and the policy (the scheduler, built here and only here) before anything starts: a plugin
        graph the config cannot build is a ConfigError naming its key before any port opens."""
        c = self.config
        self.pool.configured_ranks = c.data_parallel_ranks
        models = c.scheduling.models
        rewrite_targets = (t.model_rewrite for rule in models.rewrites for t in rule.targets)
        self.metrics = PickerMetrics(c.pool_label, models=(*models.base, *models.adapters, *rewrite_targets),
                                     namespace=c.pool_namespace, stream_metrics=c.enable_grpc_stream_metrics,
                                     deprecated_names=c.metrics_deprecated_names)
        self.policy = build_policy(c, self.metrics)

    async def start(self) -> None:
        c = self.config
        models = c.scheduling.models
        self._tasks: list[asyncio.Task[None]] = []
        # how to stop what has started, registered as each part starts; run in reverse order by stop()
        self._stoppers: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        self._stopping = False
        self.failed = asyncio.Event()  # a background task died: serving on would route on a frozen view
        await self._start_endpoint_sources(c)
        policy = self.policy
        self.scheduler = policy.scheduler
        self.shared_index = policy.shared_index
        if self.shared_index is not None:
            await self.shared_index.start()
            self.on_stop("shared prefix index", self.shared_index.stop)
            self.metrics.watch_index_sync(self.shared_index.stats)
        metrics = self.metrics
        self.pool.subscribe(lambda event, endpoint: metrics.forget_pod(endpoint) if event is PoolEvent.REMOVED else None)
        self.pool.subscribe(lambda event, _: metrics.pool.observe_restart() if event is PoolEvent.RESTARTED else None)
        self.tracer = DecisionTracer(c.otlp_endpoint) if c.otlp_endpoint else None
        if self.tracer is not None:
            self.on_stop("tracer", _awaitable(self.tracer.shutdown))
        gate = build_gate(c.admission, self.scheduler.chars_per_token, self.pool, self.metrics)
        self.tokenizer: PromptTokenizer | None = None
        if policy.precise_index is not None and c.prefix_mode != "approximate":
            self.tokenizer = (LocalTokenizer(c.tokenizer) if c.tokenizer else
                              PodTokenizer(timeout=c.tokenize_timeout, scheme=c.model_server_metrics_scheme))
            self.on_stop("tokenizer", self.tokenizer.close)
        rewrites = ModelRewrites(configured_rules(models.rewrites), rng=random.Random(c.seed))
        plugins = request_plugins.build(PluginDeps(self.scheduler, time.monotonic, rewrites, self.metrics.requests,
                                                   self.tracer))
        self.director = Director(self.pool, self.scheduler, gate=gate, plugins=plugins, priorities=policy.priorities,
                                 models=ModelServing(models.adapters), tokenizer=self.tokenizer,
                                 fallbacks=c.fallback_endpoints, media=c.multimodal)
        self.supervise(start_monitor(c, self.pool, self.scheduler, self.metrics,
                                     on_metrics=scrape_listener(gate, policy.precise_index, self.pool.ranks)))
        self.shared_load = shared_load(c, self.pool, gate, policy)
        if self.shared_load is not None:
            self.on_stop("shared load", self.shared_load.close)  # after its task is cancelled: deletes our report
            self.metrics.watch_load_sync(self.shared_load.stats)
            self.supervise(asyncio.create_task(self.shared_load.run(), name="shared-load"))
        if policy.precise_index is not None:
            start_kv_events(c, self.pool, policy.precise_index, self.metrics, self.supervise, self.on_stop)
        if c.models_refresh_interval > 0:
            self._start_model_listings(c)
        if self.discovery is not None and self.discovery.pool_name:
            self.supervise(asyncio.create_task(watch_objectives(
                self.discovery.api, self.discovery.namespace, self.discovery.pool_name,
                policy.priorities.set_discovered), name="inference-objectives"))
            self.supervise(asyncio.create_task(watch_model_rewrites(
                self.discovery.api, self.discovery.namespace, self.discovery.pool_name,
                rewrites.set_discovered), name="inference-model-rewrites"))
        try:
            await self._start_servers(c)
        except BaseException:  # a port taken: stop the scrapers, discovery and index already running
            await self.stop(grace=0)
            raise
        tls = c.tls
        certificate = f"certificate from {tls.cert_path}" if tls.cert_path else "self-signed"
        security = f"{'mTLS' if tls.client_ca else 'TLS'}, {certificate}" if tls.secure else "plaintext"
        # In the chosen log format like every other line (a JSON log parses from its first line).
        log.info("picker: ext_proc on %s:%d (%s), health on :%d, %s, %d endpoints", c.ext_proc_host, self.grpc_port,
                 security, self.health_port, f"metrics on :{self.metrics_port}" if c.metrics_port >= 0
                 else "metrics off", len(self.pool))

    def on_stop(self, name: str, stop: Callable[[], Awaitable[object]]) -> None:
        """How to stop a part that has just started: stop() runs these last first, after the background tasks are
        cancelled and the gRPC servers stopped; one that fails is logged and the others still run."""
        self._stoppers.append((name, stop))

    def supervise(self, task: asyncio.Task[None]) -> None:
        """Keep `task` for stop(); should it end by an exception, `failed` is set (serve exits non-zero)."""
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s failed, stopping: %r", task.get_name(), exc, exc_info=exc)
            self.failed.set()

    async def _start_endpoint_sources(self, c: cfg.ServeConfig) -> None:
        """Static flags, a watched file, or Kubernetes discovery (given a moment to list the pods first)."""
        if c.endpoints or c.endpoints_file:
            static = StaticEndpoints(self.pool)
            if c.endpoints:
                static.set_specs(parse_endpoint_list(c.endpoints))
            if c.endpoints_file:
                watcher = EndpointsFileWatcher(Path(c.endpoints_file), static)
                watcher.load_now()
                self.supervise(asyncio.create_task(watcher.run(), name="endpoints-file"))
            if any(spec.named for spec in static.specs):  # names: resolved before serving (briefly), then kept
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(static.resolve(), 3.0)
            self.supervise(asyncio.create_task(static.run(), name="endpoint-names"))
        self.discovery: KubernetesDiscovery | None = None
        if c.discovery != "static":
            self.discovery = discovery_from_config(c, self.pool)
            self.on_stop("kubernetes client", self.discovery.api.close)
            self.supervise(asyncio.create_task(self.discovery.run(), name="kubernetes-discovery"))
            with contextlib.suppress(TimeoutError):  # serve at once either way; the first list is usually quick
                await asyncio.wait_for(self.discovery.synced.wait(), 3.0)

    def _start_model_listings(self, c: cfg.ServeConfig) -> None:
        """Read every pod's /v1/models on a slow timer, and a joining pod's at once."""
        listings = ModelListings(self.pool.ready, interval=c.models_refresh_interval,
                                 scheme=c.model_server_metrics_scheme,
                                 verify_tls=not c.model_server_metrics_https_insecure_skip_verify)
        self.pool.subscribe(lambda event, _endpoint: listings.pod_joined()
                            if event in (PoolEvent.ADDED, PoolEvent.READY, PoolEvent.DEGRADED) else None)
        self.supervise(asyncio.create_task(listings.run(), name="model-listings"))

    async def _start_servers(self, c: cfg.ServeConfig) -> None:
        """ext_proc + picker.v1 on the gRPC port, health on its own port, Prometheus; then report health."""
        limit = c.max_body_bytes + 2**20  # headroom for the protobuf envelope
        # Flow-control windows sized by what a stream reads, not grown by bandwidth probes: otherwise Envoy may push
        # slow uploads' bodies far ahead of the picker (hundreds of MiB with 40 of them), which both fills our
        # memory and trips Envoy's own outbound-frame flood limit, resetting every stream on the connection.
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                   ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 2**16)]
        # Every server object exists before the first bind, so stop() can undo a start that failed half-way.
        self.server = grpc.aio.server(options=options)
        extproc_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(self.director, c.stream_limits,
                                                                             self.metrics.streams), self.server)
        picker_pb2_grpc.add_PickerServicer_to_server(PickerService(self.director), self.server)
        self.health = CheckedHealth()
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)

        credentials = server_credentials(c.tls, certificate_hosts(c.ext_proc_host))
        self.grpc_port = _bind_grpc(self.server, c.ext_proc_host, c.grpc_port, "--grpc-port", credentials)
        self.health_port = _bind_grpc(self.health_server, c.host, c.grpc_health_port, "--grpc-health-port")
        if c.metrics_port >= 0:
            try:
                http_server, _ = start_http_server(c.metrics_port, addr=c.host, registry=self.metrics.registry)
            except OSError as exc:
                raise BindError("--metrics-port", c.metrics_port, _reason(exc)) from None
            def close_metrics() -> None:
                http_server.shutdown()
                http_server.server_close()  # shutdown() only ends its loop: the port would stay bound

            self.on_stop("metrics server", _awaitable(close_metrics))
            self.metrics_port = http_server.server_port
        if c.tls.secure:  # a refused handshake is told in our log too (gRPC's core says so only on stderr)
            watch = HandshakeWatch(asyncio.get_running_loop())
            watch.start()
            self.on_stop("handshake watch", _awaitable(watch.stop))
        await self.server.start()
        await self.health_server.start()
        changed = asyncio.Event()  # subscribed before the first look, so no change falls in between
        self.pool.subscribe(lambda event, _: changed.set() if event in (PoolEvent.ADDED, PoolEvent.REMOVED) else None)
        ready = self._ready()
        for name in HEALTH_SERVICES:
            serving = ready or name not in READY_SERVICES
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING if serving
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if not ready:
            log.info("no endpoints yet: not ready (readiness NOT_SERVING until the pool has one)")
        self.supervise(asyncio.create_task(self._track_readiness(ready, changed), name="readiness"))

    def _ready(self) -> bool:
        """Ready once discovery (if any) has listed the pods and the pool holds an endpoint to route to."""
        synced = self.discovery is None or self.discovery.synced.is_set()
        return synced and len(self.pool) > 0

    async def _track_readiness(self, ready: bool, changed: asyncio.Event) -> None:
        """Readiness follows the pool: an empty pool (a selector matching nothing, an emptied endpoints file) is
        NOT_SERVING, so Kubernetes and Envoy's health check move to a replica or the fail-open route instead of
        sending requests to a picker that can only answer 503. `changed` is set on every pool change."""
        if self.discovery is not None and not self.discovery.synced.is_set():
            synced = self.discovery.synced

            async def wake_when_synced() -> None:
                await synced.wait()
                changed.set()
            self.supervise(asyncio.create_task(wake_when_synced(), name="discovery-synced"))
        while True:
            await changed.wait()
            changed.clear()
            now = self._ready()
            if now != ready and not self._stopping:
                status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in READY_SERVICES:
                    await self.health.set(name, status)
                log.info("%s", "endpoints discovered: ready" if now else
                         "no endpoints: not ready (readiness NOT_SERVING until the pool has one)")
                ready = now

    async def stop(self, grace: float = 2.0, delay: float = 0.0) -> None:
        """Report NOT_SERVING first so Envoy's health check moves away, keep taking new streams until every health
        checker has read that and then none came for QUIET_BEFORE_STOP (at most `delay` seconds: a stream refused
        before would take the fail-open route), then drain them."""
        self._stopping = True
        began = time.monotonic()
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = began + delay
        while (now := time.monotonic()) < deadline:
            told = self.health.all_told_since(began)
            if told is None:  # a checker still routes here: wait for its next check
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(deadline - now):
                        await self.health.next_answer()
                continue
            wait = max(told, self.metrics.streams.last_opened) + QUIET_BEFORE_STOP - now
            if wait <= 0:
                break
            await asyncio.sleep(min(wait, deadline - now))
        await cancel_all(self._tasks)
        await self.server.stop(grace)
        await self.health_server.stop(0)
        while self._stoppers:
            name, stop = self._stoppers.pop()
            try:
                await stop()
            except Exception:  # stopping the rest matters more
                log.exception("stopping the %s failed", name)


async def serve(server: PickerServer) -> None:
    # Handlers go in before any port opens: a supervisor may send SIGTERM as soon as it sees us listening.
    # SIGTERM (an orchestrator's stop) waits for the load balancers to move away; SIGINT (Ctrl-C) stops at once.
    stop = asyncio.Event()
    graceful = True
    loop = asyncio.get_running_loop()

    def stop_on(sig: signal.Signals) -> None:
        nonlocal graceful
        graceful = graceful and sig == signal.SIGTERM
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_on, sig)
    await server.start()
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(server.failed.wait())
    await asyncio.wait((stopped, failed), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed.cancel()
    await server.stop(server.config.drain_timeout, server.config.shutdown_delay if graceful else 0.0)
    if server.failed.is_set():
        raise BackgroundFailure("a background task failed (see the log above)")


class BackgroundFailure(RuntimeError):
    """Discovery, scraping or another background job ended by an error: the process exits 1."""


def run(args: argparse.Namespace) -> int:
    config_notes: list[str] = []
    try:
        config = cfg.resolve(args, config_notes)
    except (ValueError, OSError) as exc:
        print(f"picker serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    for note in reference_flags.notes(reference_flags.given(args), config.index_backend):
        log.warning("reference picker flag %s", note)
    for note in config_notes:
        log.warning("reference picker config %s", note)
    try:
        server = PickerServer(config)
    except cfg.ConfigError as exc:  # the plugin graph: only the config file or text holds it
        source = cfg.scheduling_source(args)
        print(exit_line(f"picker serve: {source + ': ' if source else ''}{exc}", config.log_format), file=sys.stderr)
        return 2
    except ValueError as exc:  # e.g. a --redis-url the client cannot parse
        print(exit_line(f"picker serve: {exc}", config.log_format), file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(server))
    except (BindError, ValueError) as exc:
        print(exit_line(f"picker serve: {exc}", config.log_format), file=sys.stderr)
        return 2
    except BackgroundFailure as exc:
        print(exit_line(f"picker serve: {exc}", config.log_format), file=sys.stderr)
        return 1
    return 0


def discovery_from_config(config: cfg.ServeConfig, pool: EndpointPool) -> KubernetesDiscovery:
    """`picker serve`'s Kubernetes discovery (`config.discovery` is "inferencepool" or "selector")."""
    kube = load_kube_config(config.kubeconfig)
    namespace = config.pool_namespace or kube.namespace
    if config.discovery == "selector":
        return KubernetesDiscovery(KubeApi(kube), pool, namespace, selector=config.endpoint_selector,
                                   ports=tuple(cfg.parse_ports(config.endpoint_target_ports)))
    return KubernetesDiscovery(KubeApi(kube), pool, namespace, pool_name=config.pool_name,
                               pool_group=config.pool_group)


def _awaitable(stop: Callable[[], object]) -> Callable[[], Awaitable[None]]:
    """A synchronous stop as the coroutine `PickerServer.on_stop` takes."""
    async def run() -> None:
        stop()
    return run
