"""Kubernetes objects → what the picker needs: an InferencePool's selector and ports, a pod's endpoints, the
priorities of InferenceObjectives, the rules of InferenceModelRewrites. Pure functions, no I/O.

Objects come from the cluster, so their shape is data, not a promise: an unusable InferencePool raises
`MalformedObject` (a ValueError) for discovery to report and wait out, a malformed pod serves nothing, an
unusable objective is skipped. None of them raise anything else for bad input, so any other exception out of
here is a bug.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from picker.core.model_rewrite import RewriteRule, RewriteRuleSpec
from picker.core.schema import ConfigError, decode
from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)


class MalformedObject(ValueError):
    """An object from the cluster that cannot be used as it stands (says which field and why)."""


@dataclass(frozen=True)
class PoolSpec:
    """What discovery needs from an InferencePool: whose pods, which ports."""

    selector: str
    ports: tuple[int, ...]


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """InferencePool v1: spec.selector.matchLabels, spec.targetPorts[].number; the older v1alpha2: a plain label
    map and spec.targetPortNumber (else MalformedObject)."""
    spec = pool.get("spec") or {}
    if not isinstance(spec, dict):
        raise MalformedObject("InferencePool spec is not a mapping")
    selector = spec.get("selector") or {}
    if not isinstance(selector, dict):
        raise MalformedObject("InferencePool spec.selector is not a mapping")
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}  # older API versions: a plain label map
    query = label_selector(selector)
    if not query:
        raise MalformedObject("InferencePool has no spec.selector.matchLabels")
    targets = spec.get("targetPorts") or []
    if not targets and "targetPortNumber" in spec:  # v1alpha2
        targets = [{"number": spec["targetPortNumber"]}]
    if not isinstance(targets, list):
        raise MalformedObject("InferencePool spec.targetPorts is not a list")
    ports = []
    for target in targets:
        number = target.get("number") if isinstance(target, dict) else None
        if not isinstance(number, int) or isinstance(number, bool) or not 0 < number < 65536:
            raise MalformedObject(f"InferencePool spec.targetPorts entry {target!r} has no port number")
        ports.append(number)
    if not ports:
        raise MalformedObject("InferencePool has no spec.targetPorts")
    return PoolSpec(query, tuple(ports))


_SET_OPERATORS = {"In": "in", "NotIn": "notin"}


def label_selector(selector: Mapping[str, Any]) -> str:
    """A LabelSelector (matchLabels + matchExpressions) as the API's labelSelector query string."""
    labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(labels, dict):
        raise MalformedObject("selector matchLabels is not a mapping")
    if not isinstance(expressions, list):
        raise MalformedObject("selector matchExpressions is not a list")
    terms = [f"{key}={value}" for key, value in sorted((str(k), str(v)) for k, v in labels.items())]
    for expression in expressions:
        if not isinstance(expression, dict):
            raise MalformedObject(f"selector expression {expression!r} is not a mapping")
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or []
        if not isinstance(key, str) or not key or not isinstance(values, list):
            raise MalformedObject(f"selector expression {expression!r} has no key or bad values")
        joined = ",".join(str(v) for v in values)
        if operator in _SET_OPERATORS and joined:
            terms.append(f"{key} {_SET_OPERATORS[operator]} ({joined})")
        elif operator == "Exists":
            terms.append(key)
        elif operator == "DoesNotExist":
            terms.append(f"!{key}")
        else:
            raise MalformedObject(f"unsupported selector expression {expression!r}")
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
    ready = isinstance(conditions, list) and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    if not ready:
        return []
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        log.warning("pod %s: podIP %r is not an IP address; it serves nothing", meta.get("name"), ip)
        return []
    name = str(meta.get("name") or ip)
    raw_labels = meta.get("labels")
    labels = {str(k): str(v) for k, v in raw_labels.items()} if isinstance(raw_labels, dict) else {}
    host = f"[{ip}]" if ":" in ip else ip
    if len(ports) == 1:
        return [Endpoint.from_address(f"{host}:{ports[0]}", name, labels)]
    return [Endpoint.from_address(f"{host}:{port}", f"{name}-rank-{rank}", labels)
            for rank, port in enumerate(ports)]


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
        priority = spec.get("priority")
        if priority is None:
            out[name] = 0
        elif isinstance(priority, int) and not isinstance(priority, bool):
            out[name] = priority
        else:
            log.warning("InferenceObjective %s: priority %r is not an integer; ignored", name, priority)
    return out


def model_rewrite_rules(rewrites: Mapping[str, Mapping[str, Any]], pool_name: str) -> list[RewriteRule]:
    """The rules of the InferenceModelRewrites whose spec.poolRef names our pool, oldest object first (the
    reference's precedence), each rule named after its object; an unusable rule is skipped with a warning."""
    ordered = sorted(rewrites.items(), key=lambda item: (_created(item[1]), item[0]))
    out: list[RewriteRule] = []
    for name, rewrite in ordered:
        spec = rewrite.get("spec")
        if not isinstance(spec, dict):
            continue
        ref = spec.get("poolRef")
        rules = spec.get("rules")
        if not isinstance(ref, dict) or ref.get("name") != pool_name or not isinstance(rules, list):
            continue
        for i, rule in enumerate(rules):
            try:
                decoded = decode(RewriteRuleSpec, rule, f"rules[{i}]")
            except ConfigError as exc:
                log.warning("InferenceModelRewrite %s: %s; rule ignored", name, exc)
                continue
            out.append(RewriteRule.from_spec(decoded.model_copy(update={"name": name}), name))
    return out


def _created(obj: Mapping[str, Any]) -> str:
    """metadata.creationTimestamp (RFC 3339 in UTC: orders as text); missing ones sort first."""
    meta = obj.get("metadata")
    stamp = meta.get("creationTimestamp") if isinstance(meta, dict) else None
    return stamp if isinstance(stamp, str) else ""
