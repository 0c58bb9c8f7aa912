"""Peer routers measured in live mode: sglang-router, vllm-router and SGLang's gateway `smg`, each pip-installed into
its own venv, as one process or as N replicas (smg's with its mesh, which syncs their cache-aware trees, or without).

Own venvs keep their dependencies away from ours; HF_HUB_OFFLINE=1 stops them from reaching for a tokenizer on
the Hub (they route on text or on the pod's /v1/completions/render token ids). Any failure (no network, no
wheel, crash at start) becomes a clear "skipped" reason instead of an error.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from picker_lab.supervisor import HOST, Managed, free_ports, port_open, spawn, wait_until

# The peers' venvs, relative to the working directory (the repository root under `make`); resolved when used.
VENVS = Path("bench") / ".venvs"


def _call(method: str, url: str, body: dict[str, object] | None = None) -> bytes:
    """One call to a peer's admin API; RuntimeError naming it when it fails."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return bytes(response.read())
    except OSError as exc:
        raise RuntimeError(f"{method} {url} failed: {exc}") from None


def _sglang_add(base_url: str, worker_url: str) -> None:
    _call("POST", f"{base_url}/workers", {"url": worker_url})  # 202: it adds the worker once healthy


def _sglang_remove(base_url: str, worker_url: str) -> None:
    """By the id it gave the worker (DELETE /workers/{id}), looked up in its list."""
    listed = json.loads(_call("GET", f"{base_url}/workers"))["workers"]
    ids = [w["id"] for w in listed if w["url"] == worker_url]
    if not ids:
        raise RuntimeError(f"sglang-router does not list {worker_url}")
    _call("DELETE", f"{base_url}/workers/{ids[0]}")


def _post_url(path: str) -> Callable[[str, str], None]:
    """vllm-router's `POST <path>?url=<worker>` (its /add_worker and /remove_worker)."""
    def call(base_url: str, worker_url: str) -> None:
        _call("POST", f"{base_url}{path}?url={urllib.parse.quote(worker_url, safe=':/')}")
    return call


@dataclass(frozen=True)
class PeerSpec:
    name: str
    requirement: str
    executable: str
    # Its own API for adding and removing a worker (base URL, worker URL): what its service discovery calls.
    add_worker: Callable[[str, str], None]
    remove_worker: Callable[[str, str], None]
    # Worker endpoints its cache-aware policy cannot do without: without them it still forwards every request,
    # but no longer routes by prefix, so a run would measure a crippled peer (start() refuses instead).
    needs: tuple[str, ...] = ()
    launch: bool = False  # its executable takes a `launch` subcommand first
    mesh: bool = False  # its replicas can sync their trees (--enable-mesh, --mesh-peer-urls)


PEERS: dict[str, PeerSpec] = {
    "sglang-router": PeerSpec("sglang-router", "sglang-router==0.3.2", "sglang-router", _sglang_add, _sglang_remove,
                              launch=True),
    # SGLang's gateway since 2026 (the router's successor): the same launch flags and workers API, plus the mesh.
    "smg": PeerSpec("smg", "smg==1.13.0", "smg", _sglang_add, _sglang_remove, launch=True, mesh=True),
    # It tokenizes each prompt with the worker's render endpoint (vLLM serves it only with --enable-scale-out).
    "vllm-router": PeerSpec("vllm-router", "vllm-router==0.1.17", "vllm-router", _post_url("/add_worker"),
                            _post_url("/remove_worker"), needs=("/v1/completions/render",)),
}


def ensure_installed(peer: PeerSpec, log: Path) -> Path:
    """The peer's executable in bench/.venvs/<name>, creating the venv and pip-installing on first use.
    Raises RuntimeError with the reason when that is not possible."""
    venv = (VENVS / peer.name).resolve()
    exe = venv / "bin" / peer.executable
    if exe.exists():
        return exe
    VENVS.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", peer.requirement]]
        for cmd in steps:
            try:
                rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise RuntimeError(f"{' '.join(cmd[:3])}... failed: {exc}") from None
            if rc != 0:
                raise RuntimeError(f"`pip install {peer.requirement}` failed (exit {rc}); see {log}")
    if not exe.exists():
        raise RuntimeError(f"{peer.requirement} installed no {peer.executable} executable")
    return exe


MESH_SUFFIX = "-mesh"


def replicated(strategy: str) -> tuple[str, int, bool]:
    """A router as named in a benchmark: "smg" (one process), "smg@4" (four behind one load balancer, each with
    its own tree), "smg-mesh@4" (four that sync their trees through the mesh), "picker@4" (four sharing an index).
    Returns (router, replicas, mesh); ValueError for a bad count or a mesh the router does not have."""
    name, at, count = strategy.partition("@")
    replicas = 1
    if at:
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{strategy!r}: the count after @ must be a whole number from 1")
        replicas = int(count)
    mesh = name.endswith(MESH_SUFFIX) and name.removesuffix(MESH_SUFFIX) in PEERS
    if mesh:
        name = name.removesuffix(MESH_SUFFIX)
        if not PEERS[name].mesh:
            raise ValueError(f"{strategy!r}: {name} has no mesh")
    return name, replicas, mesh


def is_peer(strategy: str) -> bool:
    """Whether a benchmark's router name is one of the peers (in any number of replicas)."""
    try:
        return replicated(strategy)[0] in PEERS
    except ValueError:
        return False


def command(peer: PeerSpec, exe: Path, port: int, prometheus_port: int, worker_urls: list[str],
            mesh: tuple[int, list[int]] | None = None) -> list[str]:
    """Command line of the peer in cache-aware mode; `mesh` (its mesh port, the other replicas' mesh ports) joins
    it to the others' mesh."""
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *worker_urls, "--policy", "cache_aware",
              "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port)]
    if mesh is not None:
        own, others = mesh
        common += ["--enable-mesh", "--mesh-host", HOST, "--mesh-advertise-host", HOST, "--mesh-port", str(own),
                   "--mesh-server-name", f"{peer.name}-{own}"]
        if others:
            common += ["--mesh-peer-urls", *(f"{HOST}:{p}" for p in others)]
    return [str(exe), *(["launch"] if peer.launch else []), *common]


# What the peers call on a worker before and while routing, with a body for the POSTs.
PEER_ENDPOINTS: tuple[tuple[str, str, dict[str, object] | None], ...] = (
    ("GET", "/health", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_model_info", None),
    ("POST", "/v1/completions/render", {"prompt": "hello world"}),
    ("POST", "/tokenize", {"prompt": "hello world"}),
)


def check_worker(base_url: str, timeout: float = 5.0) -> dict[str, str]:
    """Which peer-facing endpoints a worker serves: path -> "ok" or the failure. vllm-router needs the render
    endpoint to return a JSON list of {"token_ids": [...]}."""
    out: dict[str, str] = {}
    for method, path, body in PEER_ENDPOINTS:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(base_url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                payload = resp.read()
                status = int(resp.status)
        except OSError as exc:
            out[path] = f"failed: {exc}"
            continue
        if status != 200:
            out[path] = f"status {status}"
        elif path == "/v1/completions/render":
            parsed = json.loads(payload)
            ok = isinstance(parsed, list) and parsed and isinstance(parsed[0].get("token_ids"), list)
            out[path] = "ok" if ok else f"unexpected body {payload[:80]!r}"
        else:
            out[path] = "ok"
    return out


def ready(port: int) -> bool:
    """Up, and forwarding: its /health answers before it has registered its workers (sglang-router then turns
    requests away with 503), so a request it must pass on to a worker (GET /v1/models) has to succeed too."""
    if not port_open(port):
        return False
    try:
        for path in ("/health", "/v1/models"):
            with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=1) as resp:
                if int(resp.status) != 200:
                    return False
    except OSError:
        return False
    return True


def missing_endpoints(peer: PeerSpec, worker_urls: list[str]) -> list[str]:
    """"<worker><path>: <failure>" for every endpoint the peer needs that a worker does not serve."""
    missing = []
    for url in worker_urls if peer.needs else []:
        served = check_worker(url)
        missing += [f"{url}{path}: {served[path]}" for path in peer.needs if served[path] != "ok"]
    return missing


def start_replicas(peer: PeerSpec, worker_urls: list[str], logdir: Path, replicas: int = 1, mesh: bool = False
                   ) -> tuple[list[Managed], list[str]]:
    """`replicas` processes of the peer, each routing over every worker; with `mesh` each joins the mesh of those
    started before it (the first one alone: its own). Returns them and their base URLs; whatever started is
    stopped again when one fails (RuntimeError)."""
    missing = missing_endpoints(peer, worker_urls)
    if missing:
        raise RuntimeError(f"{peer.name} cannot route by prefix: its workers do not serve what it needs "
                           f"({'; '.join(missing)})")
    exe = ensure_installed(peer, logdir / f"{peer.name}-install.log")
    # every listener of every replica on a port of its own
    ports = free_ports(replicas * (3 if mesh else 2))
    mesh_ports = ports[2 * replicas:]
    started: list[Managed] = []
    urls = []
    try:
        for i in range(replicas):
            port, prometheus_port = ports[2 * i], ports[2 * i + 1]
            joined = (mesh_ports[i], mesh_ports[:i]) if mesh else None
            name = peer.name if replicas == 1 else f"{peer.name}-{i}"
            managed = spawn(name, command(peer, exe, port, prometheus_port, worker_urls, joined), logdir,
                            env={"HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "RUST_LOG": "warn"})
            started.append(managed)
            try:
                wait_until(functools.partial(ready, port), 60, name, managed.proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{name} did not start: {exc}; log tail: {managed.log()[-600:]!r}") from None
            urls.append(f"http://{HOST}:{port}")
    except BaseException:
        for managed in reversed(started):
            managed.stop()
        raise
    return started, urls


@dataclass
class PeerPool:
    """A running peer's workers moved through its own API, as a rolling restart's service discovery would: what a
    pool change publishes to a peer instead of writing an endpoints file. `addresses` are host:port."""

    peer: PeerSpec
    base_url: str
    addresses: list[str]

    def __call__(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.addresses:
                self.peer.add_worker(self.base_url, f"http://{address}")
        for address in self.addresses:
            if address not in addresses:
                self.peer.remove_worker(self.base_url, f"http://{address}")
        self.addresses = list(addresses)
