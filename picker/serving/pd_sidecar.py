"""`picker pd-sidecar`: the proxy beside a decode pod that carries out a prefill/decode decision.

The picker routes a disaggregated request to this sidecar (the decode pod's address in the pool) and names the
prefill pod in `x-prefiller-host-port`. The sidecar sends the prompt to that pod first, asking for one token and,
with vLLM's NIXL connector protocol, for its KV cache to be kept for a remote decode (`kv_transfer_params`:
`do_remote_decode`); then it sends the original request to its own decode engine with the transfer parameters the
prefill answered with, and streams the answer back. With the shared-storage connector (vLLM's ExampleConnector,
KV blocks in a directory both engines mount) the prefill writes the KV there and the decode engine finds it by
the prompt: the decode request goes unchanged. Without the header the request goes straight to the decode engine.
When the prefill pod is one rank of a data-parallel server, the picker names it in
`x-prefiller-data-parallel-rank` and the prefill leg carries it as `x-data-parallel-rank` (vLLM hands the prompt to
that engine); the decode request keeps its own `x-data-parallel-rank`, which is never passed to the prefill pod.

A failed prefill leg (unreachable, an error status, an answer without transfer parameters) costs a local prefill,
not a failed request: the original request goes to the decode engine, counted in
`picker_pd_sidecar_prefill_fallbacks_total{reason}` (the reference's sidecar returns the prefill's error instead).
Every other path (`/metrics`, `/health`, `/v1/models`, ...) is passed to the decode engine as it is.

The header decides where the sidecar sends a prompt, so only the picker should set it (it removes a client's):
`--allowed-prefillers` (addresses or CIDR blocks, e.g. the pool's pod network) refuses any other target with 403,
for callers that reach the pod without going through Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import ipaddress
import json
import logging
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from picker.core.argtypes import port, port_or_off, positive_number
from picker.core.headers import DATA_PARALLEL_RANK, PREFILLER, PREFILLER_RANK

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
CONNECTORS = ("nixlv2", "shared-storage")
# Request headers not passed on (hop-by-hop, or recomputed by the client library for the new body)
_DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", PREFILLER,
                      PREFILLER_RANK})
_NOT_RETURNED = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})

log = logging.getLogger(__name__)


class SidecarMetrics:
    """What the sidecar did with each generation request, and why a prefill leg was given up."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("picker_pd_sidecar_requests", "Generation requests by how they were prefilled: "
                                "remote (on the prefill pod), local (no prefill pod named), fallback (the prefill "
                                "leg failed; prefilled locally).", ["prefill"], registry=self.registry)
        self.fallbacks = Counter("picker_pd_sidecar_prefill_fallbacks",
                                 "Prefill legs given up for a local prefill, by reason.", ["reason"],
                                 registry=self.registry)


def prefill_headers(headers: Mapping[str, str], rank: str) -> dict[str, str]:
    """The prefill leg's headers: the request's, without the decode engine's data-parallel rank (another server's
    engine), with the prefill pod's own rank when the picker named one (digits only: anything else is dropped)."""
    out = {k: v for k, v in headers.items() if k.lower() != DATA_PARALLEL_RANK}
    rank = rank.strip()
    if rank.isdigit():
        out[DATA_PARALLEL_RANK] = rank
    elif rank:
        log.warning("ignored %s %r: not a rank", PREFILLER_RANK, rank[:40])
    return out


def prefill_body(body: dict[str, Any], path: str, connector: str) -> dict[str, Any]:
    """The prefill leg's body: one token, no stream, and (NIXL) the request to keep the KV for a remote decode."""
    out = copy.copy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    limits = ("max_tokens", "max_completion_tokens", "min_tokens") if path.endswith("/chat/completions") else \
        ("max_tokens", "min_tokens")
    for key in limits:
        out[key] = 1
    if connector == "nixlv2":
        out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return out


class PrefillFailed(Exception):
    """The prefill leg gave nothing to decode from; `reason` labels the fallback counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def allowed_networks(text: str) -> tuple[Network, ...]:
    """`--allowed-prefillers`: comma-separated addresses or CIDR blocks; ValueError naming a bad one."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"allowed-prefillers: {item!r} is not an IP address or CIDR block") from None
    return tuple(out)


def _host_of(target: str) -> str:
    """"ip:port" or "[v6]:port" -> ip."""
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    return host.strip("[]")


class Sidecar:
    def __init__(self, decoder: str, connector: str = "nixlv2", prefill_timeout: float = 60.0,
                 metrics: SidecarMetrics | None = None, allowed: Sequence[Network] = ()) -> None:
        if connector not in CONNECTORS:
            raise ValueError(f"kv-connector: {connector!r} is not one of {', '.join(CONNECTORS)}")
        self.allowed = tuple(allowed)  # empty: any prefill target (the picker is trusted to name it)
        self.decoder = decoder.rstrip("/")  # http://host:port of the decode engine
        self.connector = connector
        self.prefill_timeout = prefill_timeout
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app is not started"
        return self._session

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        prefiller = request.headers.get(PREFILLER, "").split(",")[0].strip()
        if request.method != "POST" or request.path not in GENERATION_PATHS:
            return await self._relay(request, request.method, body, headers)
        if not prefiller:
            self.metrics.requests.labels("local").inc()
            return await self._relay(request, "POST", body, headers)
        if self.allowed and not self._allowed(prefiller):
            log.warning("refused a prefill target outside --allowed-prefillers: %s", prefiller)
            return web.json_response({"error": {"code": "prefiller_not_allowed", "message": f"{PREFILLER} "
                                                f"{prefiller!r} is outside --allowed-prefillers"}}, status=403)
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            # the decode engine gives the client its own 400 for it
            return await self._fall_back(request, body, headers, PrefillFailed("bad_body", "not a JSON object"))
        headers.setdefault("x-request-id", str(uuid.uuid4()))
        try:
            params = await self._prefill(prefiller, request.path, parsed,
                                         prefill_headers(headers, request.headers.get(PREFILLER_RANK, "")))
        except PrefillFailed as failed:
            return await self._fall_back(request, body, headers, failed)
        self.metrics.requests.labels("remote").inc()
        if params is not None:  # NIXL: the decode engine fetches the blocks the prefill answered with
            body = json.dumps({**parsed, "kv_transfer_params": params}).encode()
        return await self._relay(request, "POST", body, headers)

    def _allowed(self, target: str) -> bool:
        try:
            address = ipaddress.ip_address(_host_of(target))
        except ValueError:
            return False  # a name, not an address: cannot be checked against the networks
        return any(address in network for network in self.allowed)

    async def _prefill(self, prefiller: str, path: str, body: dict[str, Any],
                       headers: Mapping[str, str]) -> dict[str, Any] | None:
        """Run the prefill leg; the transfer parameters it answered with (NIXL), None where the decode engine finds
        the KV by itself (shared storage: the request goes on as it came)."""
        url = f"http://{prefiller}{path}"
        try:
            async with self.session.post(url, json=prefill_body(body, path, self.connector), headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.prefill_timeout)) as response:
                text = await response.read()
                if response.status != 200:
                    raise PrefillFailed(f"status_{response.status}", f"{url} answered {response.status}: "
                                        f"{text[:200]!r}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise PrefillFailed("unreachable", f"{url}: {exc or type(exc).__name__}") from None
        if self.connector != "nixlv2":
            return None
        try:
            params = json.loads(text).get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise PrefillFailed("bad_answer", f"{url} answered something other than a JSON object") from None
        if not isinstance(params, dict):
            raise PrefillFailed("no_transfer_params", f"{url} returned no kv_transfer_params (is its engine "
                                "started with a KV connector, kv_role kv_producer or kv_both?)")
        return params

    async def _fall_back(self, request: web.Request, body: bytes, headers: dict[str, str],
                         failed: PrefillFailed) -> web.StreamResponse:
        log.warning("prefill leg failed, prefilling locally: %s", failed)
        self.metrics.requests.labels("fallback").inc()
        self.metrics.fallbacks.labels(failed.reason).inc()
        return await self._relay(request, "POST", body, headers)

    async def _relay(self, request: web.Request, method: str, body: bytes,
                     headers: Mapping[str, str]) -> web.StreamResponse:
        """Send to the decode engine and stream its answer back as it comes."""
        url = f"{self.decoder}{request.path_qs}"
        try:
            upstream = await self.session.request(method, url, data=body, headers=headers)
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"code": "decoder_unreachable", "message": f"{url}: {exc}"}},
                                     status=502)
        async with upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_RETURNED})
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except aiohttp.ClientError as exc:  # the engine went away mid-answer: the client sees it cut
                log.warning("decode engine %s failed mid-answer: %s", url, exc)
                return response
            await response.write_eof()
            return response


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=port, default=8000, help="port to listen on: the pod's port in the pool")
    parser.add_argument("--model-server-port", "--vllm-port", dest="model_server_port", type=port, default=8200,
                        help="the decode engine's port on --decoder-host")
    parser.add_argument("--decoder-host", default="127.0.0.1", help="the decode engine's host (default: this one)")
    parser.add_argument("--kv-connector", choices=CONNECTORS, default="nixlv2",
                        help="how the prefill hands its KV over: nixlv2 (vLLM's kv_transfer_params handshake) or "
                             "shared-storage (both engines read and write one directory)")
    parser.add_argument("--prefill-timeout", type=positive_number, default=60.0,
                        help="seconds the prefill leg may take before it is given up for a local prefill")
    parser.add_argument("--metrics-port", type=port_or_off, default=0,
                        help="serve the sidecar's /metrics on this port (0: not served)")
    parser.add_argument("--allowed-prefillers", default="",
                        help="comma-separated addresses or CIDR blocks a prefill may be sent to (e.g. the pod "
                             "network); any other x-prefiller-host-port is refused with 403 (default: any)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sidecar = Sidecar(f"http://{args.decoder_host}:{args.model_server_port}", args.kv_connector,
                          args.prefill_timeout, allowed=allowed_networks(args.allowed_prefillers))
    except ValueError as exc:
        print(f"picker pd-sidecar: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(sidecar, args.host, args.port, args.metrics_port))
    return 0


async def _serve(sidecar: Sidecar, host: str, port: int, metrics_port: int) -> None:
    runner = web.AppRunner(sidecar.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    metrics_runner: web.AppRunner | None = None
    if metrics_port:
        metrics_app = web.Application()

        async def page(request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(sidecar.metrics.registry),
                                content_type="text/plain", charset="utf-8")

        metrics_app.router.add_get("/metrics", page)
        metrics_runner = web.AppRunner(metrics_app, access_log=None)
        await metrics_runner.setup()
        await web.TCPSite(metrics_runner, host, metrics_port).start()
    log.info("pd-sidecar listening on %s:%d, decode engine %s, connector %s", host, port, sidecar.decoder,
             sidecar.connector)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    await runner.cleanup()
