"""A small stand-in for the Kubernetes API server: pods and InferencePools with LIST, GET and WATCH.

No real API server runs on these machines, so discovery is tested against this one. It keeps the parts of the
protocol discovery relies on: resourceVersions that grow with every change, watches that replay from a version,
410 for versions older than the last compaction, bearer-token auth, label and field selectors (equality).
Tests can also rotate the accepted token (`token`), make the next requests fail (`failures`: 5xx, 429 with
Retry-After), feed watches malformed events (`put_raw_event`) and lists malformed items (`put_garbage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
# GIE's older alpha InferencePool (the reference picker's --pool-group inference.networking.x-k8s.io)
ALPHA_POOLS = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencepools"
OBJECTIVES = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives"
REWRITES = "/apis/llm-d.ai/v1alpha2/namespaces/{ns}/inferencemodelrewrites"


def _status(code: int, message: str) -> dict[str, Any]:
    reason = {401: "Unauthorized", 404: "NotFound", 410: "Expired"}.get(code, "Error")
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}


def _selected(obj: Any, label_selector: str, field_selector: str) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        return True  # garbage goes to every reader, as from a broken server
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, label_selector.split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key) != value:
            return False
    for term in filter(None, field_selector.split(",")):
        key, _, value = term.partition("=")
        if key == "metadata.name" and obj["metadata"].get("name") != value:
            return False
    return True


class FakeKube:
    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self.version = 100
        self.objects: dict[tuple[str, str, str], Any] = {}  # (kind, namespace, name) -> object
        self.events: list[tuple[int, str, str, str, Any]] = []  # (version, kind, ns, type or RAW, object)
        self.compacted = 0  # watches from an older version get 410
        self.generation = 0  # bumping it ends every open watch (the server closing streams)
        self.lists: dict[str, int] = {"pods": 0, "pools": 0, "alphapools": 0, "objectives": 0, "rewrites": 0}
        self.watches: dict[str, int] = {"pods": 0, "pools": 0, "alphapools": 0, "objectives": 0, "rewrites": 0}
        self.objectives_installed = True  # False: the InferenceObjective CRD is absent (404)
        self.unauthorized = 0
        self.tokens_seen: list[str] = []  # the bearer token of every request, accepted or not
        self.pool_gets = 0  # GETs of one InferencePool (found or not)
        self.objective_misses = 0  # InferenceObjective requests answered 404 (CRD absent)
        self.failures: list[int] = []  # the next requests are answered with these statuses, one each
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # Test controls ---------------------------------------------------------------------------------------

    async def put_pod(self, namespace: str, name: str, ip: str, labels: dict[str, str], *, ready: bool = True,
                      phase: str = "Running", deleting: bool = False,
                      annotations: dict[str, str] | None = None) -> None:
        metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
        if annotations:
            metadata["annotations"] = annotations
        if deleting:
            metadata["deletionTimestamp"] = "2026-11-30T00:00:00Z"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
               "status": {"phase": phase, "podIP": ip,
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        await self._put("pods", namespace, name, pod)

    async def put_raw_pod(self, namespace: str, name: str, labels: dict[str, str], status: Any) -> None:
        """A pod whose status is whatever the test says (to check that garbage does not kill discovery)."""
        await self._put("pods", namespace, name, {"apiVersion": "v1", "kind": "Pod", "status": status,
                                                  "metadata": {"name": name, "namespace": namespace, "labels": labels}})

    async def put_pool(self, namespace: str, name: str, labels: dict[str, str], ports: list[int]) -> None:
        pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": p} for p in ports],
                         "endpointPickerRef": {"kind": "Service", "name": "picker", "port": {"number": 9002}}}}
        await self._put("pools", namespace, name, pool)

    async def put_alpha_pool(self, namespace: str, name: str, labels: dict[str, str], port: int) -> None:
        """The older alpha InferencePool: a plain label map and one targetPortNumber."""
        pool = {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"selector": labels, "targetPortNumber": port,
                         "extensionRef": {"name": "picker"}}}
        await self._put("alphapools", namespace, name, pool)

    async def put_objective(self, namespace: str, name: str, pool: str, priority: int | None) -> None:
        spec: dict[str, Any] = {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                            "name": pool}}
        if priority is not None:
            spec["priority"] = priority
        await self._put("objectives", namespace, name, {"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
                                                        "kind": "InferenceObjective", "spec": spec,
                                                        "metadata": {"name": name, "namespace": namespace}})

    async def put_rewrite(self, namespace: str, name: str, pool: str, rules: list[dict[str, Any]],
                          created: str = "2026-01-01T00:00:00Z") -> None:
        await self._put("rewrites", namespace, name, {
            "apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool},
                     "rules": rules}})

    async def put_raw_event(self, kind: str, namespace: str, event: Any) -> None:
        """A watch line of any shape (`event` as JSON), sent to the kind's watchers in `namespace`."""
        self.version += 1
        self.events.append((self.version, kind, namespace, "RAW", event))
        async with self._changed:
            self._changed.notify_all()

    def put_garbage(self, kind: str, namespace: str, key: str, obj: Any) -> None:
        """A malformed object that lists return (no event: a server does not announce garbage)."""
        self.objects[(kind, namespace, key)] = obj

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        obj = self.objects.pop((kind, namespace, name))
        await self._event(kind, namespace, "DELETED", obj)

    async def compact(self) -> None:
        """Forget history: watches from any version seen so far get 410 and must list again."""
        self.compacted = self.version + 1
        await self.drop_watches()

    async def drop_watches(self) -> None:
        self.generation += 1
        async with self._changed:
            self._changed.notify_all()

    async def _put(self, kind: str, namespace: str, name: str, obj: dict[str, Any]) -> None:
        kind_type = "MODIFIED" if (kind, namespace, name) in self.objects else "ADDED"
        self.objects[(kind, namespace, name)] = obj
        await self._event(kind, namespace, kind_type, obj)

    async def _event(self, kind: str, namespace: str, event_type: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, namespace, event_type, copy.deepcopy(obj)))
        async with self._changed:
            self._changed.notify_all()

    # Server ----------------------------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get(POOLS.format(ns="{ns}"), self._pools)
        app.router.add_get(POOLS.format(ns="{ns}") + "/{name}", self._pool)
        app.router.add_get(ALPHA_POOLS.format(ns="{ns}"), self._alpha_pools)
        app.router.add_get(ALPHA_POOLS.format(ns="{ns}") + "/{name}", self._pool)
        app.router.add_get(OBJECTIVES.format(ns="{ns}"), self._objectives)
        app.router.add_get(REWRITES.format(ns="{ns}"), self._rewrites)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        await self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, namespace: str = "default", token: str | None = None,
                   user: dict[str, Any] | None = None) -> str:
        """A kubeconfig for this server; `user` replaces the default bearer-token user stanza."""
        if user is None:
            user = {"token": self.token if token is None else token}
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "picker", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "picker", "namespace": namespace}}],
        })

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        self.tokens_seen.append(header.removeprefix("Bearer "))
        if header == f"Bearer {self.token}":
            return True
        self.unauthorized += 1
        return False

    def _refusal(self, request: web.Request) -> web.Response | None:
        """The answer to a request that does not get through: an injected failure, or a bad token."""
        if self.failures:
            code = self.failures.pop(0)
            headers = {"Retry-After": "1"} if code == 429 else {}
            return web.json_response(_status(code, "injected failure"), status=code, headers=headers)
        if not self._authorized(request):
            return web.json_response(_status(401, "Unauthorized"), status=401)
        return None

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "pods")

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "pools")

    async def _alpha_pools(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "alphapools")

    async def _objectives(self, request: web.Request) -> web.StreamResponse:
        if not self.objectives_installed:
            self.objective_misses += 1
            return web.json_response(_status(404, "the server could not find the requested resource"), status=404)
        return await self._collection(request, "objectives")

    async def _rewrites(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "rewrites")

    async def _pool(self, request: web.Request) -> web.Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        self.pool_gets += 1
        kind = "alphapools" if request.path.startswith("/apis/inference.networking.x-k8s.io/") else "pools"
        obj = self.objects.get((kind, request.match_info["ns"], request.match_info["name"]))
        if obj is None:
            return web.json_response(_status(404, "inferencepools not found"), status=404)
        return web.json_response(obj)

    async def _collection(self, request: web.Request, kind: str) -> web.StreamResponse:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        namespace = request.match_info["ns"]
        labels = request.query.get("labelSelector", "")
        fields = request.query.get("fieldSelector", "")
        if request.query.get("watch") not in ("true", "1"):
            self.lists[kind] += 1
            items = [o for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace
                     and _selected(o, labels, fields)]
            return web.json_response({"kind": "List", "metadata": {"resourceVersion": str(self.version)},
                                      "items": items})
        self.watches[kind] += 1
        since = int(request.query.get("resourceVersion") or self.version)
        response = web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request)
        if since < self.compacted:
            await response.write(json.dumps({"type": "ERROR", "object": _status(410, "too old")}).encode() + b"\n")
            return response
        generation = self.generation
        deadline = asyncio.get_running_loop().time() + float(request.query.get("timeoutSeconds") or 300)
        sent = since
        while generation == self.generation:
            for version, k, ns, event_type, obj in self.events:
                if version <= sent:
                    continue
                sent = version
                if event_type == "RAW":
                    if k == kind and ns == namespace:
                        await response.write(json.dumps(obj).encode() + b"\n")
                elif k == kind and ns == namespace and _selected(obj, labels, fields):
                    await response.write(json.dumps({"type": event_type, "object": obj}).encode() + b"\n")
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            async with self._changed:
                if self.version == sent and generation == self.generation:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), left)
        return response


class FakeKubeThread:
    """The stand-in API server on its own event loop in a thread, for tests that drive real processes
    synchronously (their waits would otherwise starve a server on the test's loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-kube", daemon=True)
        self.fake = FakeKube()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def __enter__(self) -> FakeKube:
        self.thread.start()
        self.run(self.fake.start())
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self.run(self.fake.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
