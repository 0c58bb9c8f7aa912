"""The discovery loops: keep the endpoint pool equal to the ready pods of an InferencePool (or of a label
selector), and keep the director told of the pool's InferenceObjectives (priorities) and InferenceModelRewrites.

Each loop LISTs, then WATCHes from the list's resourceVersion; a closed stream re-watches from the last
version seen, a 410 lists again. In InferencePool mode the pool object is watched too: a changed selector or
port list re-reads the pods, a deleted pool empties the set until it comes back, an unusable one empties it
until it is fixed.

What is retried, and how: only `TRANSIENT` errors (the network, timeouts, and the API server's answers: 5xx
and 429, honouring Retry-After, but also 401/403/404, which an operator fixes by applying the RBAC or creating
the pool) are logged and retried, after an exponential, capped, jittered delay that resets once a list or an
event arrives again. A malformed object is skipped where it is read (see `client` and `objects`). Anything
else, an AttributeError, KeyError, TypeError or ValueError from our own code, is a bug: it is logged with its
traceback and ends the loop, rather than being retried for ever as if the network had failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

from picker.core.model_rewrite import RewriteRule
from picker.core.retry import Backoff
from picker.endpoints.kube.client import TRANSIENT, Gone, KubeApi, KubeError
from picker.endpoints.kube.objects import (
    MalformedObject,
    PoolSpec,
    model_rewrite_rules,
    objective_priorities,
    pod_endpoints,
    pool_spec,
)
from picker.endpoints.pool import EndpointPool

log = logging.getLogger(__name__)
T = TypeVar("T")

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
# InferencePool API groups (the reference picker's --pool-group) and the version read of each
POOL_VERSIONS = {POOL_GROUP: POOL_VERSION, "inference.networking.x-k8s.io": "v1alpha2"}
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"  # InferenceObjective is alpha in GIE
OBJECTIVE_VERSION = "v1alpha2"
REWRITE_GROUP = "llm-d.ai"  # InferenceModelRewrite: the reference picker's own API
REWRITE_VERSION = "v1alpha2"
RESTART_FLOOR_S = 1.0  # a pool that changes sooner than this after we started following it waits a backoff first


def _retry_after(exc: BaseException) -> float:
    return exc.retry_after if isinstance(exc, KubeError) else 0.0


async def follow_collection(api: KubeApi, path: str, params: dict[str, str],
                            apply: Callable[[dict[str, dict[str, Any]]], None], what: str,
                            idle: Backoff | None = None) -> None:
    """LIST a collection, then WATCH it from the list's version for ever, calling `apply(objects by name)`
    after the list and after every change. An expired version (410) lists again; other errors propagate. A
    watch the server ends without a single event waits `idle`'s next delay before the next one (no spinning)."""
    idle = idle if idle is not None else Backoff(0.05, 10.0)
    objects, version = await api.list(path, params)
    apply(objects)
    while True:
        seen = 0
        try:
            async with contextlib.aclosing(api.watch(path, params, version)) as events:
                async for event in events:
                    seen += 1
                    version = event.version or version
                    if event.type == "BOOKMARK":
                        continue
                    objects = dict(objects)
                    if event.type == "DELETED":
                        objects.pop(event.name, None)
                    else:
                        objects[event.name] = event.object
                    apply(objects)
        except Gone:
            log.info("%s: watch expired, listing again", what)
            objects, version = await api.list(path, params)
            apply(objects)
            continue
        if seen:
            idle.reset()
        else:
            await idle.wait()


class KubernetesDiscovery:
    """Keeps `pool` equal to the ready pods of an InferencePool (`pool_name`) or of a label `selector`."""

    def __init__(self, api: KubeApi, pool: EndpointPool, namespace: str, *, pool_name: str = "",
                 selector: str = "", ports: tuple[int, ...] = (), retry_max: float = 10.0,
                 backoff: Backoff | None = None, pool_group: str = POOL_GROUP) -> None:
        if bool(pool_name) == bool(selector):
            raise ValueError("discover by an InferencePool name or by a label selector, exactly one")
        if selector and not ports:
            raise ValueError("a label selector needs target ports")
        self.api = api
        self.pool = pool
        self.namespace = namespace
        self.pool_name = pool_name
        if pool_group not in POOL_VERSIONS:
            raise ValueError(f"pool group {pool_group!r}: one of {', '.join(POOL_VERSIONS)}")
        self.pool_group = pool_group
        self.fixed = PoolSpec(selector, ports) if selector else None
        self.backoff = backoff or Backoff(min(0.2, retry_max), retry_max)
        self.synced = asyncio.Event()  # set after the first successful pod list

    @property
    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{quote(self.namespace)}/pods"

    @property
    def _pools_path(self) -> str:
        version = POOL_VERSIONS[self.pool_group]
        return f"/apis/{self.pool_group}/{version}/namespaces/{quote(self.namespace)}/inferencepools"

    def describe(self) -> str:
        if self.fixed is not None:
            return f"pods {self.fixed.selector!r} in {self.namespace}"
        return f"InferencePool {self.namespace}/{self.pool_name}"

    async def run(self) -> None:
        """Follow the cluster for ever; returns only by cancellation, raises only on a bug."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self._follow()  # returns when the pool object changed: start over
                if loop.time() - started < RESTART_FLOOR_S:
                    # changed again at once: a pool flapping (or a server replaying its events) must not spin
                    await self.backoff.wait()
            except TRANSIENT as exc:
                delay = max(self.backoff.next_delay(), _retry_after(exc))
                log.warning("discovery of %s: %s; retrying in %.1fs", self.describe(),
                            exc or type(exc).__name__, delay)
                await self.backoff.sleep(delay)
            except Exception:
                log.exception("discovery of %s stopped: an unexpected error is a bug, not retried",
                              self.describe())
                raise

    async def _follow(self) -> None:
        spec, version = await self._read_spec()
        followers = [asyncio.create_task(self._follow_pods(spec))] if spec is not None else []
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

    async def _read_spec(self) -> tuple[PoolSpec | None, str]:
        """The pods to follow (None: the pool is unusable, follow only the pool) and the pool's version."""
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
        meta = pool.get("metadata")
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        version = version if isinstance(version, str) else ""
        try:
            spec = pool_spec(pool)
        except MalformedObject as exc:
            log.warning("InferencePool %s/%s: %s; no endpoints until it is fixed", self.namespace,
                        self.pool_name, exc)
            self._replace_pods({}, None)
            return None, version
        log.info("InferencePool %s/%s: pods %r, ports %s", self.namespace, self.pool_name, spec.selector,
                 ",".join(map(str, spec.ports)))
        return spec, version

    async def _follow_pool(self, spec: PoolSpec | None, version: str) -> None:
        """Returns when the pool's selector or ports change, it is deleted or its watch expired (the caller
        starts over)."""
        params = {"fieldSelector": f"metadata.name={self.pool_name}"}
        while True:
            seen = 0
            try:
                async with contextlib.aclosing(self.api.watch(self._pools_path, params, version)) as events:
                    async for event in events:
                        seen += 1
                        version = event.version or version
                        if event.type == "DELETED":
                            log.warning("InferencePool %s/%s deleted", self.namespace, self.pool_name)
                            return
                        if event.type in ("ADDED", "MODIFIED"):
                            try:
                                changed = pool_spec(event.object) != spec
                            except MalformedObject:
                                changed = spec is not None  # broken now, or still broken: nothing new to do
                            if changed:
                                return
            except Gone:
                return
            if not seen:  # a watch that ends without a single event, again and again, must not spin either
                await self.backoff.wait()

    async def _follow_pods(self, spec: PoolSpec) -> None:
        def update(pods: dict[str, dict[str, Any]]) -> None:
            self._replace_pods(pods, spec)
            self.backoff.reset()
            self.synced.set()

        await follow_collection(self.api, self._pods_path, {"labelSelector": spec.selector}, update,
                                self.describe(), Backoff(0.05, self.backoff.cap))

    def _replace_pods(self, pods: dict[str, dict[str, Any]], spec: PoolSpec | None) -> None:
        """The pool becomes the endpoints of `pods` (none without a spec: the InferencePool is gone)."""
        endpoints = [e for pod in pods.values() for e in pod_endpoints(pod, spec.ports)] if spec else []
        before = {e.address for e in self.pool.all()}
        if before == {e.address for e in endpoints}:
            return
        added, removed = self.pool.set_endpoints(endpoints)
        log.info("discovery of %s: %d endpoints (+%d, -%d)", self.describe(), len(self.pool), len(added),
                 len(removed))


async def watch_objectives(api: KubeApi, namespace: str, pool_name: str,
                           on_change: Callable[[dict[str, int]], None], *, retry: float = 60.0,
                           backoff: Backoff | None = None) -> None:
    """Keep `on_change` told of the priorities of the pool's InferenceObjectives (GIE: the request header
    `x-gateway-inference-objective` names one)."""
    await watch_pool_objects(
        api, f"/apis/{OBJECTIVE_GROUP}/{OBJECTIVE_VERSION}/namespaces/{quote(namespace)}/inferenceobjectives",
        f"InferenceObjectives of {namespace}/{pool_name}", lambda objects: objective_priorities(objects, pool_name),
        on_change, lambda p: ", ".join(f"{k}={v}" for k, v in sorted(p.items())),
        "the InferenceObjective API is not installed; priorities come from the config only", retry, backoff)


async def watch_model_rewrites(api: KubeApi, namespace: str, pool_name: str,
                               on_change: Callable[[list[RewriteRule]], None], *, retry: float = 60.0,
                               backoff: Backoff | None = None) -> None:
    """Keep `on_change` told of the rules of the pool's InferenceModelRewrites (oldest object first)."""
    await watch_pool_objects(
        api, f"/apis/{REWRITE_GROUP}/{REWRITE_VERSION}/namespaces/{quote(namespace)}/inferencemodelrewrites",
        f"InferenceModelRewrites of {namespace}/{pool_name}", lambda objects: model_rewrite_rules(objects, pool_name),
        on_change, lambda rules: ", ".join(f"{r.name}: {', '.join(sorted(r.models)) or '*'} -> "
                                           f"{', '.join(r.targets)}" for r in rules),
        "the InferenceModelRewrite API is not installed; rewrites come from the config only", retry, backoff)


async def watch_pool_objects(api: KubeApi, path: str, what: str,
                             extract: Callable[[dict[str, dict[str, Any]]], T], on_change: Callable[[T], None],
                             describe: Callable[[T], str], not_installed: str, retry: float = 60.0,
                             backoff: Backoff | None = None) -> None:
    """Follow a collection of objects that refer to the pool and tell `on_change` what `extract` makes of them
    whenever that changes. A cluster without the CRD is asked again every `retry` s; transient errors are
    retried with `backoff`, a bug ends the loop."""
    delays = backoff or Backoff(0.2, 10.0)
    last: list[T] = []

    def apply(objects: dict[str, dict[str, Any]]) -> None:
        delays.reset()
        current = extract(objects)
        if not last or current != last[0]:
            last[:] = [current]
            on_change(current)
            log.info("%s: %s", what, describe(current) or "none")

    while True:
        try:
            await follow_collection(api, path, {}, apply, what, delays)
        except KubeError as exc:
            if exc.status != 404:
                delay = max(delays.next_delay(), exc.retry_after)
                log.warning("%s: %s; retrying in %.1fs", what, exc, delay)
                await delays.sleep(delay)
                continue
            log.info("%s: %s", what, not_installed)
            await delays.sleep(retry)
        except TRANSIENT as exc:
            delay = delays.next_delay()
            log.warning("%s: %s; retrying in %.1fs", what, exc or type(exc).__name__, delay)
            await delays.sleep(delay)
        except Exception:
            log.exception("%s: stopped; an unexpected error is a bug, not retried", what)
            raise
