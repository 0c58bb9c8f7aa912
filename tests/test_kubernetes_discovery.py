"""Kubernetes discovery: InferencePool / label-selector pods → endpoints, against a stand-in API server.

Also the credentials (a rotated token file, exec credential plugins, refused auth mechanisms) and what is
retried (transient errors, with backoff) and what is not (a malformed object is skipped, a bug ends the loop).
Tests wait on conditions (`eventually`, `wait_until`, events), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.core.model_rewrite import RewriteRule
from picker.core.requests import InferenceRequest
from picker.core.retry import Backoff
from picker.endpoints.kubernetes import (
    CredentialsError,
    ExecCredentials,
    ExecPlugin,
    KubeApi,
    KubeConfig,
    KubeError,
    KubernetesDiscovery,
    TokenFile,
    WatchEvent,
    follow_collection,
    load_kube_config,
    objective_priorities,
    parse_exec_credential,
    pod_endpoints,
    pool_spec,
    watch_model_rewrites,
    watch_objectives,
)
from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.state import Endpoint
from picker.routing.admission import AdmissionConfig, Priorities
from picker.serving.config import ServeConfig
from picker.serving.server import discovery_from_config
from picker_lab.supervisor import (
    Envoy,
    free_port,
    process_scope,
    set_echo_metrics,
    spawn,
    start_envoy,
    start_picker,
    wait_until,
)
from tests.kubefake import POOLS, FakeKube, FakeKubeThread
from tests.waiting import eventually

NS = "llm"
LABELS = {"app": "vllm-llama3"}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = FakeKube()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


@contextlib.asynccontextmanager
async def running(discovery: KubernetesDiscovery, *, synced: bool = False) -> AsyncIterator[KubernetesDiscovery]:
    """Discovery running in the background (`synced`: once it has listed the pods), stopped on exit."""
    task = asyncio.create_task(discovery.run())
    try:
        if synced:
            await asyncio.wait_for(discovery.synced.wait(), 5)
        yield discovery
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await discovery.api.close()


async def llama_with_one_pod(kube: FakeKube) -> None:
    """InferencePool `llama` (port 8000) selecting one ready pod, vllm-0 at 10.1.0.1."""
    await kube.put_pool(NS, "llama", LABELS, [8000])
    await kube.put_pod(NS, "vllm-0", "10.1.0.1", LABELS)


def addresses(pool: EndpointPool) -> set[str]:
    return {e.address for e in pool.all()}


def pod(ip: str = "10.1.0.5", *, phase: str = "Running", ready: str = "True", deleting: bool = False,
        name: str = "vllm-0") -> dict[str, object]:
    meta: dict[str, object] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": ready}]}}


# Pure rules ------------------------------------------------------------------------------------------------

def test_only_running_ready_pods_with_an_ip_serve() -> None:
    assert [e.address for e in pod_endpoints(pod(), (8000,))] == ["10.1.0.5:8000"]
    assert pod_endpoints(pod(), (8000,))[0].name == "vllm-0"
    assert pod_endpoints(pod(ready="False"), (8000,)) == []
    assert pod_endpoints(pod(phase="Pending"), (8000,)) == []
    assert pod_endpoints(pod(ip=""), (8000,)) == []
    assert pod_endpoints(pod(deleting=True), (8000,)) == []
    assert pod_endpoints({"metadata": {"name": "x"}, "status": {"phase": "Running", "podIP": "10.1.0.5"}},
                         (8000,)) == []  # no Ready condition yet


def test_each_target_port_is_one_endpoint_and_ipv6_is_bracketed() -> None:
    ranks = pod_endpoints(pod(), (8000, 8001))
    assert [(e.address, e.name) for e in ranks] == [("10.1.0.5:8000", "vllm-0-rank-0"),
                                                    ("10.1.0.5:8001", "vllm-0-rank-1")]
    assert pod_endpoints(pod(ip="fd00::5"), (8000,))[0].address == "[fd00::5]:8000"


def test_pool_spec_reads_v1_fields_and_refuses_an_unusable_pool() -> None:
    spec = pool_spec({"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}},
                               "targetPorts": [{"number": 8000}, {"number": 8001}]}})
    assert spec.selector == "a=1,b=2" and spec.ports == (8000, 8001)
    expressions = pool_spec({"spec": {"targetPorts": [{"number": 8000}], "selector": {
        "matchLabels": {"app": "vllm"},
        "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "tpu"]},
                             {"key": "canary", "operator": "DoesNotExist"},
                             {"key": "zone", "operator": "Exists"}]}}})
    assert expressions.selector == "app=vllm,tier in (gpu,tpu),!canary,zone"
    assert pool_spec({"spec": {"selector": {"app": "old"}, "targetPorts": [{"number": 8000}]}}).selector == "app=old"
    with pytest.raises(ValueError, match="selector"):
        pool_spec({"spec": {"targetPorts": [{"number": 8000}]}})
    with pytest.raises(ValueError, match="unsupported"):
        pool_spec({"spec": {"targetPorts": [{"number": 8000}],
                            "selector": {"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}}})
    with pytest.raises(ValueError, match="targetPorts"):
        pool_spec({"spec": {"selector": {"matchLabels": {"a": "1"}}}})


# Credentials -------------------------------------------------------------------------------------------------

def test_kubeconfig_gives_server_token_and_namespace(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("""
current-context: dev
contexts:
- name: dev
  context: {cluster: c1, user: u1, namespace: team-a}
clusters:
- name: c1
  cluster: {server: "http://127.0.0.1:6443/"}
users:
- name: u1
  user: {token: s3cret}
""")
    config = load_kube_config(str(path), environ={})
    assert (config.server, config.token, config.namespace, config.ssl_context) == (
        "http://127.0.0.1:6443", "s3cret", "team-a", None)


def test_kubeconfig_with_https_uses_its_certificate_authority(tmp_path: Path) -> None:
    cafile = ssl.get_default_verify_paths().cafile or ssl.get_default_verify_paths().openssl_cafile
    path = tmp_path / "kubeconfig"
    path.write_text(f"""
current-context: prod
contexts: [{{name: prod, context: {{cluster: c, user: u}}}}]
clusters: [{{name: c, cluster: {{server: "https://10.0.0.1:6443", certificate-authority: "{cafile}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
""")
    config = load_kube_config(str(path), environ={})
    assert config.ssl_context is not None and config.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert config.namespace == "default"


def test_in_cluster_service_account_is_used_when_present(tmp_path: Path) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token\n")
    (account / "namespace").write_text("inference\n")
    cafile = ssl.get_default_verify_paths().cafile or ssl.get_default_verify_paths().openssl_cafile
    (account / "ca.crt").write_text(Path(str(cafile)).read_text())
    config = load_kube_config("", environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
                              service_account=account, token_max_age=5.0)
    assert (config.server, config.namespace) == ("https://10.96.0.1:443", "inference")
    assert isinstance(config.credentials, TokenFile)  # read per request as it rotates, not once at start-up
    assert (config.credentials.path, config.credentials.max_age) == (account / "token", 5.0)
    assert asyncio.run(config.auth().token()) == "pod-token"


def test_no_cluster_and_no_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a cluster"):
        load_kube_config("", environ={"KUBECONFIG": str(tmp_path / "missing")}, service_account=tmp_path / "none")
    broken = tmp_path / "broken"
    broken.write_text("current-context: nope\ncontexts: []\n")
    with pytest.raises(ValueError, match="no context named 'nope'"):
        load_kube_config(str(broken), environ={})


# Against the stand-in API server -----------------------------------------------------------------------------

def discovery(kube: FakeKube, pool: EndpointPool, *, token: str | None = None, pool_name: str = "llama",
              selector: str = "", ports: tuple[int, ...] = (), api: KubeApi | None = None,
              backoff: Backoff | None = None, pool_group: str = "inference.networking.k8s.io"
              ) -> KubernetesDiscovery:
    api = api or KubeApi(KubeConfig(kube.url, NS, kube.token if token is None else token))
    return KubernetesDiscovery(api, pool, NS, pool_name=pool_name, selector=selector, ports=ports,
                               retry_max=0.2, backoff=backoff, pool_group=pool_group)


async def test_the_older_alpha_inference_pool_is_read_with_its_pool_group(kube: FakeKube) -> None:
    """--pool-group inference.networking.x-k8s.io (the reference's flag): GIE's v1alpha2 InferencePool, a plain
    label map and one targetPortNumber; the v1 pool of the same name is not the one read."""
    await kube.put_alpha_pool(NS, "llama", LABELS, 8000)
    await kube.put_pool(NS, "llama", {"app": "someone-else"}, [9000])
    await kube.put_pod(NS, "vllm-0", "10.1.0.1", LABELS)
    pool = EndpointPool()
    async with running(discovery(kube, pool, pool_group="inference.networking.x-k8s.io"), synced=True):
        assert addresses(pool) == {"10.1.0.1:8000"}
    with pytest.raises(ValueError, match="pool group"):
        discovery(kube, EndpointPool(), pool_group="example.com")


async def test_inference_pool_pods_follow_readiness_additions_and_deletions(kube: FakeKube) -> None:
    await kube.put_pool(NS, "llama", LABELS, [8000])
    await kube.put_pod(NS, "vllm-0", "10.1.0.1", LABELS)
    await kube.put_pod(NS, "vllm-1", "10.1.0.2", LABELS)
    await kube.put_pod(NS, "starting", "10.1.0.3", LABELS, ready=False)
    await kube.put_pod(NS, "other-app", "10.1.0.9", {"app": "other"})
    await kube.put_pod("elsewhere", "vllm-x", "10.2.0.1", LABELS)
    pool = EndpointPool()
    removed: list[str] = []
    pool.subscribe(lambda event, e: removed.append(e.address) if event is PoolEvent.REMOVED else None)
    async with running(discovery(kube, pool), synced=True):
        assert addresses(pool) == {"10.1.0.1:8000", "10.1.0.2:8000"}
        await kube.put_pod(NS, "starting", "10.1.0.3", LABELS, ready=True)
        await eventually(lambda: "10.1.0.3:8000" in addresses(pool))
        await kube.put_pod(NS, "vllm-0", "10.1.0.1", LABELS, deleting=True)  # terminating: stop picking it now
        await eventually(lambda: "10.1.0.1:8000" not in addresses(pool))
        await kube.delete("pods", NS, "vllm-1")
        await eventually(lambda: addresses(pool) == {"10.1.0.3:8000"})
        assert removed == ["10.1.0.1:8000", "10.1.0.2:8000"]  # listeners purge the prefix index
        assert pool.get("10.1.0.3:8000").name == "starting"  # type: ignore[union-attr]
    assert kube.lists["pods"] == 1  # one list, then only the watch


async def test_a_changed_pool_rereads_its_pods_and_a_deleted_pool_empties_the_set(kube: FakeKube) -> None:
    await llama_with_one_pod(kube)
    await kube.put_pod(NS, "canary", "10.1.0.7", {"app": "canary"})
    pool = EndpointPool()
    async with running(discovery(kube, pool), synced=True):
        await kube.put_pool(NS, "llama", LABELS, [8000, 8001])  # two data-parallel ranks per pod
        await eventually(lambda: addresses(pool) == {"10.1.0.1:8000", "10.1.0.1:8001"})
        await kube.put_pool(NS, "llama", {"app": "canary"}, [9000])  # a new selector
        await eventually(lambda: addresses(pool) == {"10.1.0.7:9000"})
        await kube.delete("pools", NS, "llama")
        await eventually(lambda: addresses(pool) == set())
        await kube.put_pool(NS, "llama", LABELS, [8000])  # back again
        await eventually(lambda: addresses(pool) == {"10.1.0.1:8000"}, within=10)


async def test_expired_watches_relist_and_closed_watches_resume(kube: FakeKube) -> None:
    await llama_with_one_pod(kube)
    pool = EndpointPool()
    async with running(discovery(kube, pool), synced=True):
        await eventually(lambda: kube.watches["pods"] == 1)
        await kube.drop_watches()  # the server ends the streams: re-watch from the last version, no new list
        await eventually(lambda: kube.watches["pods"] >= 2)
        await kube.put_pod(NS, "vllm-1", "10.1.0.2", LABELS)
        await eventually(lambda: "10.1.0.2:8000" in addresses(pool))
        assert kube.lists["pods"] == 1
        await kube.compact()  # history gone: 410, so list again, and nothing is missed
        await kube.delete("pods", NS, "vllm-0")
        await eventually(lambda: addresses(pool) == {"10.1.0.2:8000"})
        assert kube.lists["pods"] >= 2


async def test_a_malformed_pod_does_not_stop_discovery(kube: FakeKube) -> None:
    await llama_with_one_pod(kube)
    pool = EndpointPool()
    async with running(discovery(kube, pool), synced=True):
        await kube.put_raw_pod(NS, "broken", LABELS, ["not", "a", "status"])
        await kube.put_raw_pod(NS, "odd", LABELS, {"phase": "Running", "podIP": "10.1.0.3", "conditions": "yes"})
        await kube.put_pod(NS, "vllm-1", "10.1.0.4", LABELS)  # events after the garbage still arrive
        await eventually(lambda: addresses(pool) == {"10.1.0.1:8000", "10.1.0.4:8000"})
        assert kube.lists["pods"] == 1  # the garbage serves nothing and breaks nothing
        await kube.put_pod(NS, "broken", "10.1.0.2", LABELS)  # fixed
        await eventually(lambda: addresses(pool) == {"10.1.0.1:8000", "10.1.0.2:8000", "10.1.0.4:8000"})


async def test_label_selector_mode_needs_no_pool_object(kube: FakeKube) -> None:
    await kube.put_pod(NS, "a", "10.1.0.1", {"app": "vllm", "tier": "gpu"})
    await kube.put_pod(NS, "b", "10.1.0.2", {"app": "vllm", "tier": "cpu"})
    pool = EndpointPool()
    d = discovery(kube, pool, pool_name="", selector="app=vllm,tier=gpu", ports=(8000,))
    async with running(d, synced=True):
        assert addresses(pool) == {"10.1.0.1:8000"}
    assert kube.lists["pools"] == 0 and kube.watches["pools"] == 0


async def test_a_missing_pool_or_bad_credentials_keep_retrying_without_endpoints(kube: FakeKube) -> None:
    pool = EndpointPool()
    async with running(discovery(kube, pool)):
        await eventually(lambda: kube.pool_gets >= 2)  # asked, not found, asked again
        assert addresses(pool) == set()
        await llama_with_one_pod(kube)
        await eventually(lambda: addresses(pool) == {"10.1.0.1:8000"})  # found once it exists
    denied = EndpointPool()
    async with running(discovery(kube, denied, token="wrong")):
        await eventually(lambda: kube.unauthorized >= 2)
        assert addresses(denied) == set()


def test_discovery_mode_comes_from_the_flags(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    fake = FakeKube()
    fake.url = "http://127.0.0.1:1"  # never contacted: building discovery only reads the kubeconfig
    kubeconfig.write_text(fake.kubeconfig(namespace="team-b"))
    assert ServeConfig(endpoints="10.0.0.1:8000").discovery == "static"
    assert ServeConfig(pool_name="llama", endpoints="10.0.0.1:8000").discovery == "static"  # a label only
    by_pool = discovery_from_config(ServeConfig(pool_name="llama", kubeconfig=str(kubeconfig)), EndpointPool())
    assert (by_pool.pool_name, by_pool.namespace, by_pool.fixed) == ("llama", "team-b", None)
    by_labels = discovery_from_config(ServeConfig(endpoint_selector="app=x", endpoint_target_ports="8000,8001",
                                                  pool_namespace="ns", kubeconfig=str(kubeconfig)), EndpointPool())
    assert by_labels.fixed is not None and by_labels.fixed.ports == (8000, 8001) and by_labels.namespace == "ns"


# Through real Envoy: a picker process discovers an InferencePool's pods from the API server ---------------------

def _served_by(envoy: Envoy, text: str) -> str:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(f"{envoy.url}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.loads(response.read())["served_by"])


def _listed(grpc_port: int) -> set[str]:
    """The addresses in the running picker's pool (its picker.v1 ListEndpoints)."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = picker_pb2_grpc.PickerStub(channel)
        listing = stub.ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
    return {e.address for e in listing.endpoints}


def _bound(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, int(port))) == 0


def test_envoy_routes_to_the_pods_an_inference_pool_selects(tmp_path: Path) -> None:
    port = free_port()
    pods = {f"vllm-{i}": f"127.0.0.{i + 2}" for i in range(3)}  # loopback addresses stand in for pod IPs
    addresses_of = {name: f"{ip}:{port}" for name, ip in pods.items()}
    thread = FakeKubeThread()
    with thread as kube, process_scope("kube") as (logdir, started):
        backends = spawn("pods", [sys.executable, "-m", "picker_lab.echo", *addresses_of.values()], logdir)
        started.append(backends)
        for address in addresses_of.values():
            wait_until(lambda a=address: _bound(a), 20, f"pod {address}", backends.proc)  # type: ignore[misc]
        thread.run(kube.put_pool(NS, "llama", LABELS, [port]))
        for name in ("vllm-0", "vllm-1"):
            thread.run(kube.put_pod(NS, name, pods[name], LABELS))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kube.kubeconfig(namespace=NS))
        picker = start_picker(logdir, extra=["--pool-name", "llama", "--kubeconfig", str(kubeconfig)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, list(addresses_of.values()))
        started.append(envoy.process)

        served = {_served_by(envoy, f"cold question {i} " * 30) for i in range(8)}
        assert served == {addresses_of["vllm-0"], addresses_of["vllm-1"]}

        thread.run(kube.put_pod(NS, "vllm-2", pods["vllm-2"], LABELS))  # scaled up: picked within moments
        deadline = time.monotonic() + 10
        while _served_by(envoy, f"new pod {time.monotonic()} " * 30) != addresses_of["vllm-2"]:
            assert time.monotonic() < deadline, "the new pod was never picked"

        thread.run(kube.delete("pods", NS, "vllm-0"))  # scaled down: never picked again
        wait_until(lambda: addresses_of["vllm-0"] not in _listed(picker.grpc_port), 10,
                   "vllm-0 gone from the pool", picker.process.proc)
        after = {_served_by(envoy, f"after delete {i} " * 30) for i in range(8)}
        assert after == {addresses_of["vllm-1"], addresses_of["vllm-2"]}
        assert picker.process.alive() and "discovery of InferencePool llm/llama" in picker.process.log()


def test_serve_outside_a_cluster_says_what_is_missing(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": ""}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--pool-name", "llama", "--grpc-port", "0",
                             "--grpc-health-port", "0", "--metrics-port", "-1"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "needs a cluster" in result.stderr
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--endpoint-selector", "app=x",
                             "--metrics-port", "-1"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "--endpoint-target-ports" in result.stderr


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def test_the_picker_is_not_ready_until_its_pool_is_discovered_and_has_a_pod(tmp_path: Path) -> None:
    thread = FakeKubeThread()
    with thread as kube, process_scope("kube-ready") as (logdir, started):
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kube.kubeconfig(namespace=NS))
        picker = start_picker(logdir, extra=["--pool-name", "llama", "--kubeconfig", str(kubeconfig)])
        started.append(picker.process)
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(picker.health_port, "liveness") == serving
        for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert _health(picker.health_port, service) == not_serving  # no InferencePool yet
        thread.run(kube.put_pool(NS, "llama", LABELS, [8000]))
        wait_until(lambda: "not ready (readiness NOT_SERVING until the pool has one)" in picker.process.log(), 15,
                   "the picker says its discovered pool is empty", picker.process.proc)
        assert _health(picker.health_port, "readiness") == not_serving  # discovered, but no pod yet
        thread.run(kube.put_pod(NS, "vllm-0", "10.1.0.1", LABELS))
        wait_until(lambda: _health(picker.health_port, "readiness") == serving, 15, "readiness",
                   picker.process.proc)
        assert _health(picker.health_port, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
        thread.run(kube.delete("pods", NS, "vllm-0"))
        wait_until(lambda: _health(picker.health_port, "readiness") == not_serving, 15, "not ready once empty",
                   picker.process.proc)
        assert _health(picker.health_port, "liveness") == serving


# InferenceObjectives → priorities ------------------------------------------------------------------------------

def test_objective_priorities_are_those_of_our_pool() -> None:
    def objective(pool: str, priority: object = None) -> dict[str, object]:
        spec: dict[str, object] = {"poolRef": {"name": pool}}
        if priority is not None:
            spec["priority"] = priority
        return {"spec": spec}

    objectives: dict[str, dict[str, object]] = {
        "chat": objective("llama", 10), "batch": objective("llama", -1), "plain": objective("llama"),
        "elsewhere": objective("mistral", 5), "bad": objective("llama", "high"), "odd": {"spec": []}}
    assert objective_priorities(objectives, "llama") == {"chat": 10, "batch": -1, "plain": 0}


def test_configured_objectives_win_over_discovered_ones() -> None:
    priorities = Priorities(AdmissionConfig.from_dict({"objectives": {"chat": 3}}))
    priorities.set_discovered({"chat": -5, "batch": -1})

    def priority(objective: str | None) -> int:
        return priorities.of(InferenceRequest("r", "m", prompt_text="x", objective=objective))

    assert (priority("chat"), priority("batch"), priority("unknown"), priority(None)) == (3, -1, 0, 0)


async def test_objectives_follow_the_cluster_and_a_missing_crd_is_not_an_error(kube: FakeKube) -> None:
    seen: list[dict[str, int]] = []
    api = KubeApi(KubeConfig(kube.url, NS, kube.token))
    kube.objectives_installed = False
    task = asyncio.create_task(watch_objectives(api, NS, "llama", seen.append, retry=0.2))
    try:
        await eventually(lambda: kube.objective_misses >= 2)  # asked again later, quietly
        assert seen == [] and not task.done() and kube.lists["objectives"] == 0 and kube.unauthorized == 0
        await kube.put_objective(NS, "chat", "llama", 10)
        await kube.put_objective(NS, "other-pool", "mistral", 7)
        kube.objectives_installed = True
        await eventually(lambda: seen[-1:] == [{"chat": 10}])
        await kube.put_objective(NS, "batch", "llama", -1)
        await eventually(lambda: seen[-1:] == [{"chat": 10, "batch": -1}])
        await kube.put_objective(NS, "batch", "llama", 0)
        await eventually(lambda: seen[-1:] == [{"chat": 10, "batch": 0}])
        await kube.delete("objectives", NS, "chat")
        await eventually(lambda: seen[-1:] == [{"batch": 0}])
        await kube.put_objective(NS, "other-pool", "mistral", 8)  # not ours: no new report
        await kube.put_objective(NS, "late", "llama", 1)  # ours, after it: once this is seen, so was that
        await eventually(lambda: seen[-1:] == [{"batch": 0, "late": 1}])
        assert len(seen) == 5
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()


async def test_model_rewrites_follow_the_cluster(kube: FakeKube) -> None:
    seen: list[list[RewriteRule]] = []
    api = KubeApi(KubeConfig(kube.url, NS, kube.token))
    task = asyncio.create_task(watch_model_rewrites(api, NS, "llama", seen.append, retry=0.2))
    canary = [{"matches": [{"model": {"value": "llama"}}],
               "targets": [{"modelRewrite": "llama-v1", "weight": 9}, {"modelRewrite": "llama-v2", "weight": 1}]}]
    try:
        await kube.put_rewrite(NS, "canary", "llama", canary, created="2026-02-01T00:00:00Z")
        await kube.put_rewrite(NS, "theirs", "mistral", [{"targets": [{"modelRewrite": "x"}]}])
        await eventually(lambda: [[(r.name, r.targets) for r in rules] for rules in seen[-1:]]
                         == [[("canary", ("llama-v1", "llama-v2"))]])
        await kube.put_rewrite(NS, "older", "llama", [{"targets": [{"modelRewrite": "any"}]}],
                               created="2026-01-01T00:00:00Z")
        await eventually(lambda: [r.name for r in seen[-1]] == ["older", "canary"])  # oldest first
        await kube.delete("rewrites", NS, "canary")
        await eventually(lambda: [r.name for r in seen[-1]] == ["older"])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()


def test_envoy_sheds_by_the_priority_an_inference_objective_declares(tmp_path: Path) -> None:
    """Drop-in behaviour: the client names an InferenceObjective; its spec.priority decides shedding."""
    thread = FakeKubeThread()
    with thread as kube, process_scope("kube-objectives") as (logdir, started):
        port = free_port()
        address = f"127.0.0.2:{port}"
        backends = spawn("pods", [sys.executable, "-m", "picker_lab.echo", address], logdir)
        started.append(backends)
        wait_until(lambda: _bound(address), 20, "pod", backends.proc)
        thread.run(kube.put_pool(NS, "llama", LABELS, [port]))
        thread.run(kube.put_pod(NS, "vllm-0", "127.0.0.2", LABELS))
        thread.run(kube.put_objective(NS, "batch", "llama", -1))
        thread.run(kube.put_objective(NS, "interactive", "llama", 5))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(kube.kubeconfig(namespace=NS))
        picker = start_picker(logdir, extra=["--pool-name", "llama", "--kubeconfig", str(kubeconfig)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, [address])
        started.append(envoy.process)
        set_echo_metrics(address, waiting=20, running=4, kv=0.99)  # saturated

        def status(objective: str) -> int:
            body = json.dumps({"model": "tiny", "prompt": "hello"}).encode()
            request = urllib.request.Request(f"{envoy.url}/v1/completions", data=body, headers={
                "content-type": "application/json", "x-gateway-inference-objective": objective})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return int(response.status)
            except urllib.error.HTTPError as err:
                return int(err.code)

        # once the picker has scraped the saturated pod and read the objectives
        wait_until(lambda: status("batch") == 429, 10, "batch shed", picker.process.proc)
        assert status("interactive") == 200 and status("unknown-objective") == 200
        thread.run(kube.put_objective(NS, "batch", "llama", 0))  # the platform team promotes batch traffic
        wait_until(lambda: status("batch") == 200, 10, "batch admitted", picker.process.proc)


# Credentials that rotate or expire --------------------------------------------------------------------------

async def test_a_rotated_token_file_is_read_again_and_a_401_forces_a_reread(kube: FakeKube,
                                                                            tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    kube.token = "first"
    now = [0.0]
    source = TokenFile(token_file, max_age=60.0, clock=lambda: now[0])
    api = KubeApi(KubeConfig(kube.url, NS, credentials=source))
    await llama_with_one_pod(kube)
    pool = EndpointPool()
    async with running(discovery(kube, pool, api=api), synced=True):
        await eventually(lambda: kube.watches["pods"] == 1 and kube.watches["pools"] == 1)
        token_file.write_text("second\n")  # the kubelet rotated it; the server accepts only the new one
        kube.token = "second"
        now[0] = 61.0  # the token in hand is older than a minute: read the file again before the next request
        await kube.drop_watches()
        await eventually(lambda: kube.watches["pods"] == 2 and kube.watches["pools"] == 2)
        assert kube.unauthorized == 0 and kube.tokens_seen[-2:] == ["second", "second"]

        token_file.write_text("third\n")  # rotated again, the token in hand still fresh: the 401 says read it
        kube.token = "third"
        await kube.drop_watches()
        await eventually(lambda: kube.watches["pods"] == 3 and kube.watches["pools"] == 3)
        assert 1 <= kube.unauthorized <= 2 and kube.tokens_seen[-1] == "third"
        await kube.put_pod(NS, "vllm-1", "10.1.0.2", LABELS)
        await eventually(lambda: "10.1.0.2:8000" in addresses(pool))
    assert kube.lists["pods"] == 1  # each refusal was answered by the request itself, not by starting over


async def test_an_unreadable_token_file_keeps_the_last_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    with pytest.raises(CredentialsError, match="token file"):
        await TokenFile(token_file).token()  # never readable: no token to send
    token_file.write_text("kept\n")
    source = TokenFile(token_file, max_age=0.0)
    assert await source.token() == "kept"
    token_file.unlink()  # e.g. a remount in progress
    assert await source.token() == "kept"


PLUGIN = '''
import json, os, pathlib, sys
state = pathlib.Path(sys.argv[1])
runs = state / "runs"
runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
(state / "greeting").write_text(os.environ.get("PLUGIN_GREETING", ""))
if (state / "fail").exists():
    sys.exit("the identity provider is down")
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
status = {"token": (state / "token").read_text().strip()}
if (state / "expiry").exists():
    status["expirationTimestamp"] = (state / "expiry").read_text().strip()
print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": status}))
'''


def exec_plugin(tmp_path: Path, token: str) -> tuple[Path, Path]:
    """A credential plugin script and its state directory (token to hand out, runs counted)."""
    script, state = tmp_path / "plugin.py", tmp_path / "plugin-state"
    script.write_text(PLUGIN)
    state.mkdir()
    (state / "token").write_text(token)
    return script, state


def runs(state: Path) -> int:
    path = state / "runs"
    return int(path.read_text()) if path.exists() else 0


async def test_an_exec_credential_plugin_is_run_once_and_again_after_a_401(kube: FakeKube,
                                                                            tmp_path: Path) -> None:
    script, state = exec_plugin(tmp_path, "minted-1")
    kube.token = "minted-1"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube.kubeconfig(namespace=NS, user={"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
        "args": [str(script), str(state)],
        "env": [{"name": "PLUGIN_GREETING", "value": "hello"}], "interactiveMode": "Never"}}))
    config = load_kube_config(str(kubeconfig), environ={})
    assert isinstance(config.credentials, ExecCredentials)
    await llama_with_one_pod(kube)
    pool = EndpointPool()
    async with running(discovery(kube, pool, api=KubeApi(config)), synced=True):
        await eventually(lambda: kube.watches["pods"] == 1 and kube.watches["pools"] == 1)
        assert runs(state) == 1 and (state / "greeting").read_text() == "hello"  # no expiry: cached
        assert set(kube.tokens_seen) == {"minted-1"}
        (state / "token").write_text("minted-2")  # the old token is revoked: the 401 re-runs the plugin
        kube.token = "minted-2"
        await kube.drop_watches()
        await eventually(lambda: kube.watches["pods"] == 2 and kube.watches["pools"] == 2)
        assert runs(state) == 2 and kube.tokens_seen[-1] == "minted-2"
    assert kube.lists["pods"] == 1


async def test_an_exec_credential_is_cached_until_it_expires(kube: FakeKube, tmp_path: Path) -> None:
    script, state = exec_plugin(tmp_path, "short-lived-1")
    (state / "expiry").write_text("2030-01-01T00:00:00Z")
    kube.token = "short-lived-1"
    expiry = datetime(2030, 1, 1, tzinfo=UTC).timestamp()
    now = [expiry - 3600]
    plugin = ExecPlugin(sys.executable, (str(script), str(state)), (), "client.authentication.k8s.io/v1beta1")
    credentials = ExecCredentials(plugin, clock=lambda: now[0], margin=10.0)
    api = KubeApi(KubeConfig(kube.url, NS, credentials=credentials))
    await kube.put_pool(NS, "llama", LABELS, [8000])
    path = POOLS.format(ns=NS) + "/llama"
    try:
        await api.get(path)
        await api.get(path)
        assert runs(state) == 1  # valid for an hour: one run serves both
        credentials.invalidate("an-older-token")  # a late 401 for a token already replaced: no new run
        await api.get(path)
        assert runs(state) == 1
        (state / "token").write_text("short-lived-2")
        kube.token = "short-lived-2"
        now[0] = expiry - 5  # inside the margin: mint a new one before the old one lapses
        await api.get(path)
        assert runs(state) == 2 and kube.tokens_seen[-1] == "short-lived-2" and kube.unauthorized == 0
        (state / "fail").write_text("")
        now[0] = expiry + 60
        with pytest.raises(KubeError, match="the identity provider is down"):
            await api.get(path)
    finally:
        await api.close()


def test_exec_credential_output_is_checked() -> None:
    v1 = "client.authentication.k8s.io/v1"

    def credential(status: object, version: str = v1) -> bytes:
        return json.dumps({"apiVersion": version, "kind": "ExecCredential", "status": status}).encode()

    assert parse_exec_credential(credential({"token": "t"}), v1) == ("t", None)
    expiring = credential({"token": "t", "expirationTimestamp": "2030-01-01T00:00:00Z"})
    assert parse_exec_credential(expiring, v1) == ("t", datetime(2030, 1, 1, tzinfo=UTC).timestamp())
    for output, problem in [(b"not json", "no JSON"), (credential({"token": "t"}, "other/v1"), "answered in"),
                            (credential({}), "no status.token"), (credential([]), "no status"),
                            (credential({"clientCertificateData": "PEM"}), "client certificate"),
                            (credential({"token": "t", "expirationTimestamp": "soon"}), "RFC 3339")]:
        with pytest.raises(CredentialsError, match=problem):
            parse_exec_credential(output, v1)


def write_kubeconfig(tmp_path: Path, user: dict[str, Any]) -> Path:
    fake = FakeKube()
    fake.url = "http://127.0.0.1:1"  # never contacted
    path = tmp_path / "kubeconfig"
    path.write_text(fake.kubeconfig(user=user))
    return path


def test_kubeconfig_auth_mechanisms_picker_cannot_use_are_refused_by_name(tmp_path: Path) -> None:
    exec_v1 = {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable}
    refused: list[tuple[dict[str, Any], str]] = [
            ({"auth-provider": {"name": "gcp", "config": {}}}, "auth-provider 'gcp'"),
            ({"auth-provider": {"name": "oidc", "config": {"refresh-token": "r"}}}, "auth-provider 'oidc'"),
            ({"username": "admin", "password": "secret"}, "basic auth"),
            ({"token": "t", "as": "someone-else"}, "impersonation"),
            ({"exec": {**exec_v1, "apiVersion": "client.authentication.k8s.io/v1alpha1"}}, "v1alpha1"),
            ({"exec": {**exec_v1, "command": "no-such-credential-plugin", "installHint": "get it from IT"}},
             "not installed.*get it from IT"),
            ({"exec": {**exec_v1, "interactiveMode": "Always"}}, "unattended")]
    for user, problem in refused:
        with pytest.raises(ValueError, match=problem):
            load_kube_config(str(write_kubeconfig(tmp_path, user)), environ={})


async def test_kubeconfig_token_sources_that_still_work(tmp_path: Path) -> None:
    oidc = load_kube_config(str(write_kubeconfig(tmp_path, {"auth-provider": {
        "name": "oidc", "config": {"id-token": "id.jwt", "idp-issuer-url": "https://issuer"}}})), environ={})
    assert await oidc.auth().token() == "id.jwt"
    (tmp_path / "token-file").write_text("from-file\n")
    both: dict[str, Any] = {"tokenFile": "token-file", "token": "unused"}  # the file wins, as in kubectl
    by_file = load_kube_config(str(write_kubeconfig(tmp_path, both)), environ={})
    assert isinstance(by_file.credentials, TokenFile) and await by_file.auth().token() == "from-file"
    assert await load_kube_config(str(write_kubeconfig(tmp_path, {})), environ={}).auth().token() == ""


def test_serve_with_an_unsupported_auth_provider_says_so_without_a_traceback(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path, {"auth-provider": {"name": "azure", "config": {}}})
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--pool-name", "llama", "--kubeconfig",
                             str(kubeconfig), "--grpc-port", "0", "--grpc-health-port", "0",
                             "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "auth-provider 'azure'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# What is retried, what is skipped, what is a bug ----------------------------------------------------------

async def test_a_malformed_object_is_skipped_and_the_watch_goes_on(kube: FakeKube) -> None:
    await llama_with_one_pod(kube)
    kube.put_garbage("pods", NS, "junk", ["not", "an", "object"])  # in the list
    pool = EndpointPool()
    async with running(discovery(kube, pool), synced=True):
        assert addresses(pool) == {"10.1.0.1:8000"}
        await eventually(lambda: kube.watches["pods"] == 1)
        for raw in ("not an event", {"type": "ADDED", "object": ["x"]},
                    {"type": "MODIFIED", "object": {"metadata": 7}},
                    {"type": "SURPRISE", "object": {"metadata": {"name": "vllm-9"}}},
                    {"type": "ADDED", "object": {"metadata": {"name": 5, "resourceVersion": "1"}}}):
            await kube.put_raw_event("pods", NS, raw)
        big = {"notes": "x" * 300_000}  # one event longer than aiohttp's readline allows
        await kube.put_pod(NS, "vllm-1", "10.1.0.4", LABELS, annotations=big)
        await eventually(lambda: addresses(pool) == {"10.1.0.1:8000", "10.1.0.4:8000"})
        assert kube.lists["pods"] == 1 and kube.watches["pods"] == 1  # the same watch carried on


async def test_transient_errors_are_retried_with_backoff_honouring_retry_after(kube: FakeKube) -> None:
    await llama_with_one_pod(kube)
    delays: list[float] = []

    async def no_wait(delay: float) -> None:
        delays.append(delay)

    kube.failures = [503, 500, 429]
    pool = EndpointPool()
    backoff = Backoff(0.2, 5.0, rand=lambda: 0.5, sleep=no_wait)
    async with running(discovery(kube, pool, backoff=backoff), synced=True):
        assert addresses(pool) == {"10.1.0.1:8000"}
    assert delays == [0.1, 0.2, 1.0]  # half of 0.2, 0.4, 0.8 (the jitter), then the server's Retry-After: 1
    assert backoff.failures == 0  # reset by the successful list


class BrokenPool(EndpointPool):
    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
        raise AttributeError("a bug in our own code")


async def test_a_bug_ends_discovery_instead_of_being_retried(kube: FakeKube) -> None:
    await llama_with_one_pod(kube)
    d = discovery(kube, BrokenPool())
    try:
        with pytest.raises(AttributeError, match="a bug"):
            await asyncio.wait_for(d.run(), 5)
    finally:
        await d.api.close()
    assert kube.lists["pods"] == 1 and not d.synced.is_set()

    api = KubeApi(KubeConfig(kube.url, NS, kube.token))

    def broken(objects: dict[str, dict[str, object]]) -> None:
        raise KeyError("also a bug")

    try:
        with pytest.raises(KeyError):
            await asyncio.wait_for(watch_objectives(api, NS, "llama", lambda priorities: broken({})), 5)
        with pytest.raises(KeyError):
            pods = f"/api/v1/namespaces/{NS}/pods"
            await asyncio.wait_for(follow_collection(api, pods, {}, broken, "pods"), 5)
    finally:
        await api.close()
    assert kube.lists["objectives"] == 1 and kube.lists["pods"] == 2


class SilentApi(KubeApi):
    """An API server whose every watch ends at once without an event."""

    def __init__(self) -> None:
        super().__init__(KubeConfig("http://127.0.0.1:1", NS, "token"))
        self.watches = 0

    async def list(self, path: str, params: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], str]:
        return {}, "1"

    async def watch(self, path: str, params: Mapping[str, str], version: str) -> AsyncGenerator[WatchEvent, None]:
        self.watches += 1
        events: tuple[WatchEvent, ...] = ()
        for event in events:
            yield event


async def test_watches_that_end_at_once_are_spaced_by_the_backoff_not_spun() -> None:
    api = SilentApi()
    waits: list[float] = []

    async def sleep(delay: float) -> None:
        waits.append(delay)
        if len(waits) == 3:
            raise asyncio.CancelledError  # enough: the loop would go on for ever

    try:
        with pytest.raises(asyncio.CancelledError):
            await follow_collection(api, "/api/v1/pods", {}, lambda objects: None, "pods",
                                    Backoff(0.05, 1.0, jitter="none", sleep=sleep))
    finally:
        await api.close()
    assert api.watches == 3 and waits == [0.05, 0.1, 0.2]  # one backoff step per empty watch
