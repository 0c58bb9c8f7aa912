"""Kubernetes discovery: the pods of an InferencePool (or of a label selector) become the picker's endpoints.

LIST, then WATCH from the list's resourceVersion (a 410 Gone relists; a closed stream re-watches), over the API
server's REST interface with the pod's service account (in cluster) or a kubeconfig; no client library needed.
Only Running, Ready pods with an IP and no deletion timestamp count. Each of the pool's target ports on a pod is one
endpoint (data-parallel ranks behind one pod IP). In InferencePool mode the pool object is watched too: a changed
selector or port list re-reads the pods, a deleted pool empties the set until it comes back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import yaml

from picker.config import ServeConfig, parse_ports
from picker.endpoints.pool import EndpointPool
from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"  # InferenceObjective is alpha in GIE
OBJECTIVE_VERSION = "v1alpha2"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_TIMEOUT_SECONDS = 300  # the API server closes each watch after this; we re-watch from the last version


class KubeError(Exception):
    """The API server refused a call (status and its message) or could not be reached."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


class _Gone(Exception):
    """The resourceVersion we watch from is too old (HTTP 410): list again."""


@dataclass(frozen=True)
class KubeConfig:
    server: str
    namespace: str
    token: str = ""
    ssl_context: ssl.SSLContext | None = None  # None: plain HTTP or the system trust store


@dataclass(frozen=True)
class PoolSpec:
    """What discovery needs from an InferencePool: whose pods, which ports."""

    selector: str
    ports: tuple[int, ...]


# Credentials --------------------------------------------------------------------------------------------------

def load_kube_config(kubeconfig: str = "", *, environ: Mapping[str, str] | None = None,
                     service_account: Path = SERVICE_ACCOUNT) -> KubeConfig:
    """An explicit kubeconfig, else the in-cluster service account, else $KUBECONFIG or ~/.kube/config."""
    env = os.environ if environ is None else environ
    if kubeconfig:
        return _from_kubeconfig(Path(kubeconfig))
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    token_path = service_account / "token"
    if host and token_path.exists():
        context = ssl.create_default_context(cafile=str(service_account / "ca.crt"))
        namespace_path = service_account / "namespace"
        namespace = namespace_path.read_text().strip() if namespace_path.exists() else "default"
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return KubeConfig(server, namespace, token_path.read_text().strip(), context)
    path = env.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
    if Path(path).exists():
        return _from_kubeconfig(Path(path))
    raise ValueError("Kubernetes discovery needs a cluster: not running in one (no service account) and no "
                     "kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config); or give --endpoints instead")


def _named(items: Any, name: str, what: str, path: Path) -> dict[str, Any]:
    for item in items or ():
        if isinstance(item, dict) and item.get("name") == name:
            return dict(item.get(what) or {})
    raise ValueError(f"{path}: no {what} named {name!r}")


def _from_kubeconfig(path: Path) -> KubeConfig:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"kubeconfig {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"kubeconfig {path}: not a YAML mapping")
    current = data.get("current-context")
    if not current:
        raise ValueError(f"kubeconfig {path}: no current-context")
    context = _named(data.get("contexts"), current, "context", path)
    cluster = _named(data.get("clusters"), context.get("cluster", ""), "cluster", path)
    user = _named(data.get("users"), context.get("user", ""), "user", path) if context.get("user") else {}
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise ValueError(f"kubeconfig {path}: cluster server {server!r} is not an http(s) URL")
    token = str(user.get("token") or "")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    ssl_context = _ssl_context(cluster, user, path.parent) if server.startswith("https://") else None
    return KubeConfig(server, str(context.get("namespace") or "default"), token, ssl_context)


def _material(entry: Mapping[str, Any], key: str, base: Path, temp: list[str]) -> str | None:
    """A file path for `key` (relative to the kubeconfig) or for `key-data` (base64, written to a temp file)."""
    if entry.get(f"{key}-data"):
        handle = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")  # noqa: SIM115 - removed below
        with handle:
            handle.write(base64.b64decode(entry[f"{key}-data"]))
        temp.append(handle.name)
        return handle.name
    if entry.get(key):
        return str(base / entry[key])
    return None


def _ssl_context(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> ssl.SSLContext:
    temp: list[str] = []
    try:
        context = ssl.create_default_context(cafile=_material(cluster, "certificate-authority", base, temp))
        if cluster.get("insecure-skip-tls-verify"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        cert = _material(user, "client-certificate", base, temp)
        if cert:
            context.load_cert_chain(cert, _material(user, "client-key", base, temp))
        return context
    finally:
        for name in temp:
            with contextlib.suppress(OSError):
                os.unlink(name)


# The API -----------------------------------------------------------------------------------------------------

class KubeApi:
    """The few REST calls discovery makes: GET one object or a list, and WATCH a collection."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Accept": "application/json"}
            if self.config.token:
                headers["Authorization"] = f"Bearer {self.config.token}"
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context or False) \
                if self.config.server.startswith("https://") else aiohttp.TCPConnector()
            self._session = aiohttp.ClientSession(self.config.server, headers=headers, connector=connector,
                                                  timeout=aiohttp.ClientTimeout(total=None, connect=5,
                                                                                sock_read=WATCH_TIMEOUT_SECONDS + 30))
        return self._session

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        async with self._client().get(path, params=params) as response:
            body = await response.read()
            if response.status != 200:
                raise KubeError(response.status, _status_message(body))
        data = json.loads(body)
        if not isinstance(data, dict):
            raise KubeError(0, f"GET {path}: not a JSON object")
        return data

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Watch events ({type, object}) until the server ends the stream."""
        query = {**params, "watch": "true", "timeoutSeconds": str(WATCH_TIMEOUT_SECONDS)}
        async with self._client().get(path, params=query) as response:
            if response.status == 410:
                raise _Gone()
            if response.status != 200:
                raise KubeError(response.status, _status_message(await response.read()))
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if not isinstance(event, dict):
                    raise KubeError(0, f"watch {path}: an event is not a JSON object")
                yield event

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _status_message(body: bytes) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body).get("message") or body[:200].decode(errors="replace"))
    return body[:200].decode(errors="replace")


# Objects → endpoints -----------------------------------------------------------------------------------------

def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """InferencePool v1: spec.selector.matchLabels and spec.targetPorts[].number (ValueError if unusable)."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    if not isinstance(selector, dict):
        raise ValueError("InferencePool spec.selector is not a mapping")
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}  # older API versions: a plain label map
    query = label_selector(selector)
    if not query:
        raise ValueError("InferencePool has no spec.selector.matchLabels")
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or () if isinstance(p, dict) and "number" in p)
    if not ports:
        raise ValueError("InferencePool has no spec.targetPorts")
    return PoolSpec(query, ports)


_SET_OPERATORS = {"In": "in", "NotIn": "notin"}


def label_selector(selector: Mapping[str, Any]) -> str:
    """A LabelSelector (matchLabels + matchExpressions) as the API's labelSelector query string."""
    terms = [f"{key}={value}" for key, value in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or ():
        key, operator = expression.get("key"), expression.get("operator")
        values = ",".join(str(v) for v in expression.get("values") or ())
        if operator in _SET_OPERATORS and values:
            terms.append(f"{key} {_SET_OPERATORS[operator]} ({values})")
        elif operator == "Exists":
            terms.append(str(key))
        elif operator == "DoesNotExist":
            terms.append(f"!{key}")
        else:
            raise ValueError(f"unsupported selector expression {expression!r}")
    return ",".join(terms)


def pod_endpoints(pod: Mapping[str, Any], ports: tuple[int, ...]) -> list[Endpoint]:
    """The endpoints a pod serves now: none unless it is Running, Ready, has an IP and is not being deleted
    (a malformed pod object serves nothing rather than stopping discovery)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if not isinstance(meta, dict) or not isinstance(status, dict):
        return []
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or not isinstance(ip, str) or not ip or status.get("phase") != "Running":
        return []
    conditions = status.get("conditions")
    if not isinstance(conditions, list) or not any(
            isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return []
    name = str(meta.get("name") or ip)
    host = f"[{ip}]" if ":" in ip else ip
    if len(ports) == 1:
        return [Endpoint.from_address(f"{host}:{ports[0]}", name)]
    return [Endpoint.from_address(f"{host}:{port}", f"{name}-rank-{rank}") for rank, port in enumerate(ports)]


# Discovery ---------------------------------------------------------------------------------------------------

# What a follower retries after (with backoff): the API's refusals, the network, and malformed answers.
_RETRYABLE = (KubeError, _Gone, aiohttp.ClientError, TimeoutError, OSError, ValueError, TypeError, KeyError,
              AttributeError)

async def follow_collection(api: KubeApi, path: str, params: Mapping[str, str],
                            apply: Callable[[dict[str, dict[str, Any]]], None], what: str) -> None:
    """LIST a collection, then WATCH it from the list's version for ever, calling `apply(objects by name)` after
    the list and after every change. An expired version (410) lists again; other errors propagate."""
    async def listing() -> tuple[dict[str, dict[str, Any]], str]:
        data = await api.get(path, params)
        found = {str((o.get("metadata") or {}).get("name")): o for o in data.get("items") or ()}
        apply(found)
        return found, str((data.get("metadata") or {}).get("resourceVersion") or "")

    objects, version = await listing()
    while True:
        try:
            query = {**params, "resourceVersion": version, "allowWatchBookmarks": "true"}
            async for event in api.watch(path, query):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise KubeError(int(obj.get("code") or 0), str(obj.get("message")))
                meta = obj.get("metadata") or {}
                version = str(meta.get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                objects = dict(objects)
                if kind == "DELETED":
                    objects.pop(str(meta.get("name") or ""), None)
                else:
                    objects[str(meta.get("name") or "")] = obj
                apply(objects)
        except _Gone:
            log.info("%s: watch expired, listing again", what)
            objects, version = await listing()


class KubernetesDiscovery:
    """Keeps `pool` equal to the ready pods of an InferencePool (`pool_name`) or of a label `selector`."""

    def __init__(self, api: KubeApi, pool: EndpointPool, namespace: str, *, pool_name: str = "",
                 selector: str = "", ports: tuple[int, ...] = (), retry_max: float = 10.0) -> None:
        if bool(pool_name) == bool(selector):
            raise ValueError("discover by an InferencePool name or by a label selector, exactly one")
        if selector and not ports:
            raise ValueError("a label selector needs target ports")
        self.api = api
        self.pool = pool
        self.namespace = namespace
        self.pool_name = pool_name
        self.fixed = PoolSpec(selector, ports) if selector else None
        self.retry_max = retry_max
        self.synced = asyncio.Event()  # set after the first successful pod list

    @property
    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{quote(self.namespace)}/pods"

    @property
    def _pools_path(self) -> str:
        return f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/{quote(self.namespace)}/inferencepools"

    def describe(self) -> str:
        if self.fixed is not None:
            return f"pods {self.fixed.selector!r} in {self.namespace}"
        return f"InferencePool {self.namespace}/{self.pool_name}"

    async def run(self) -> None:
        delay = 0.2
        while True:
            try:
                spec, version = await self._read_spec()
                followers = [asyncio.create_task(self._follow_pods(spec))]
                if self.fixed is None:
                    followers.append(asyncio.create_task(self._follow_pool(spec, version)))
                try:
                    done, _ = await asyncio.wait(followers, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in followers:
                        task.cancel()
                    for task in followers:
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
                for task in done:
                    task.result()  # re-raise what ended it
                delay = 0.2  # the pool changed: start over at once
            except _RETRYABLE as exc:
                log.warning("discovery of %s: %s; retrying in %.1fs", self.describe(), exc or type(exc).__name__,
                            delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)

    async def _read_spec(self) -> tuple[PoolSpec, str]:
        if self.fixed is not None:
            return self.fixed, ""
        try:
            pool = await self.api.get(f"{self._pools_path}/{quote(self.pool_name)}")
        except KubeError as exc:
            if exc.status == 404:
                self._replace_pods({}, None)
                raise KubeError(404, f"InferencePool {self.namespace}/{self.pool_name} not found: "
                                     "no endpoints until it exists") from exc
            raise
        try:
            spec = pool_spec(pool)
        except (ValueError, TypeError, KeyError) as exc:
            self._replace_pods({}, None)
            raise ValueError(f"InferencePool {self.namespace}/{self.pool_name}: {exc}") from exc
        log.info("InferencePool %s/%s: pods %r, ports %s", self.namespace, self.pool_name, spec.selector,
                 ",".join(map(str, spec.ports)))
        return spec, str((pool.get("metadata") or {}).get("resourceVersion") or "")

    async def _follow_pool(self, spec: PoolSpec, version: str) -> None:
        """Returns when the pool's selector or ports change, or it is deleted (the caller starts over)."""
        params = {"fieldSelector": f"metadata.name={self.pool_name}"}
        while True:
            if version:
                params["resourceVersion"] = version
            async for event in self.api.watch(self._pools_path, params):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise _Gone() if obj.get("code") == 410 else KubeError(int(obj.get("code") or 0),
                                                                          str(obj.get("message")))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "DELETED":
                    log.warning("InferencePool %s/%s deleted", self.namespace, self.pool_name)
                    return
                if kind in ("ADDED", "MODIFIED"):
                    try:
                        changed = pool_spec(obj) != spec
                    except ValueError:
                        changed = True
                    if changed:
                        return

    async def _follow_pods(self, spec: PoolSpec) -> None:
        def update(pods: dict[str, dict[str, Any]]) -> None:
            self._replace_pods(pods, spec)
            self.synced.set()

        await follow_collection(self.api, self._pods_path, {"labelSelector": spec.selector}, update, self.describe())

    def _replace_pods(self, pods: dict[str, dict[str, Any]], spec: PoolSpec | None) -> None:
        """The pool becomes the endpoints of `pods` (none without a spec: the InferencePool is gone)."""
        endpoints = [e for pod in pods.values() for e in pod_endpoints(pod, spec.ports)] if spec else []
        before = {e.address for e in self.pool.all()}
        if before == {e.address for e in endpoints}:
            return
        added, removed = self.pool.set_endpoints(endpoints)
        log.info("discovery of %s: %d endpoints (+%d, -%d)", self.describe(), len(self.pool), len(added),
                 len(removed))


# InferenceObjectives → priorities ------------------------------------------------------------------------------

def objective_priorities(objectives: Mapping[str, Mapping[str, Any]], pool_name: str) -> dict[str, int]:
    """{objective name: spec.priority} for the InferenceObjectives whose spec.poolRef names our pool (priority
    absent: 0; an unusable one is skipped with a warning)."""
    out: dict[str, int] = {}
    for name, objective in objectives.items():
        spec = objective.get("spec")
        if not isinstance(spec, dict):
            continue
        ref = spec.get("poolRef")
        if not isinstance(ref, dict) or ref.get("name") != pool_name:
            continue
        try:
            out[name] = int(spec.get("priority") or 0)
        except (TypeError, ValueError):
            log.warning("InferenceObjective %s: priority %r is not an integer; ignored", name, spec.get("priority"))
    return out


async def watch_objectives(api: KubeApi, namespace: str, pool_name: str,
                           on_change: Callable[[dict[str, int]], None], *, retry: float = 60.0) -> None:
    """Keep `on_change` told of the priorities of the pool's InferenceObjectives (GIE: the request header
    `x-gateway-inference-objective` names one). A cluster without the CRD is asked again every `retry` s."""
    path = f"/apis/{OBJECTIVE_GROUP}/{OBJECTIVE_VERSION}/namespaces/{quote(namespace)}/inferenceobjectives"
    what = f"InferenceObjectives of {namespace}/{pool_name}"
    last: dict[str, int] | None = None

    def apply(objects: dict[str, dict[str, Any]]) -> None:
        nonlocal last
        priorities = objective_priorities(objects, pool_name)
        if priorities != last:
            last = priorities
            on_change(priorities)
            log.info("%s: %s", what, ", ".join(f"{k}={v}" for k, v in sorted(priorities.items())) or "none")

    delay = 0.2
    while True:
        try:
            await follow_collection(api, path, {}, apply, what)
            continue
        except KubeError as exc:
            if exc.status == 404:
                log.info("%s: the InferenceObjective API is not installed; priorities come from the config only",
                         what)
                await asyncio.sleep(retry)
                continue
            problem: BaseException = exc
        except _RETRYABLE as exc:
            problem = exc
        log.warning("%s: %s; retrying in %.1fs", what, problem or type(problem).__name__, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)


def discovery_from_config(config: ServeConfig, pool: EndpointPool) -> KubernetesDiscovery:
    """`picker serve`'s Kubernetes discovery (`config.discovery` is "inferencepool" or "selector")."""
    kube = load_kube_config(config.kubeconfig)
    namespace = config.pool_namespace or kube.namespace
    if config.discovery == "selector":
        return KubernetesDiscovery(KubeApi(kube), pool, namespace, selector=config.endpoint_selector,
                                   ports=tuple(parse_ports(config.endpoint_target_ports)))
    return KubernetesDiscovery(KubeApi(kube), pool, namespace, pool_name=config.pool_name)
