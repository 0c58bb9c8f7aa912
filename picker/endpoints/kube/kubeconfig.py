"""Which API server to talk to and as whom: the in-cluster service account or a kubeconfig.

Credentials are sources, not values (see `credentials`): the service-account token and a kubeconfig
`tokenFile` are re-read as they rotate, an `exec` plugin is run again when its token expires. Supported
kubeconfig users: `token`, `tokenFile`, client certificates (`client-certificate[-data]`,
`client-key[-data]`), `exec` plugins (client.authentication.k8s.io/v1 and v1beta1) and, of the legacy
`auth-provider`s, only an OIDC `id-token` already written in the kubeconfig (used as is, never refreshed).
Anything else (basic auth, impersonation, other auth providers, a plugin that needs a terminal or is not
installed) is refused here, at start-up, with a ValueError naming the mechanism, rather than failing every
request later.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from picker.endpoints.kube.credentials import (
    EXEC_API_VERSIONS,
    TOKEN_MAX_AGE,
    Credentials,
    ExecCredentials,
    ExecPlugin,
    StaticToken,
    TokenFile,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_BASIC = "basic auth (username/password)"
_IMPERSONATION = ("as", "as-uid", "as-groups", "as-user-extra")
_UNSUPPORTED_USER_KEYS = {"username": _BASIC, "password": _BASIC,
                          **{key: f"impersonation ({key})" for key in _IMPERSONATION}}


@dataclass(frozen=True)
class KubeConfig:
    """An API server and how to authenticate to it (`credentials`, else the fixed `token`, else nothing)."""

    server: str
    namespace: str
    token: str = ""
    ssl_context: ssl.SSLContext | None = None  # None: plain HTTP or the system trust store
    credentials: Credentials | None = None

    def auth(self) -> Credentials:
        return self.credentials if self.credentials is not None else StaticToken(self.token)


def load_kube_config(kubeconfig: str = "", *, environ: Mapping[str, str] | None = None,
                     service_account: Path = SERVICE_ACCOUNT,
                     token_max_age: float = TOKEN_MAX_AGE) -> KubeConfig:
    """An explicit kubeconfig, else the in-cluster service account, else $KUBECONFIG or ~/.kube/config."""
    env = os.environ if environ is None else environ
    if kubeconfig:
        return _from_kubeconfig(Path(kubeconfig), token_max_age)
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    token_path = service_account / "token"
    if host and token_path.exists():
        try:
            context = ssl.create_default_context(cafile=str(service_account / "ca.crt"))
        except OSError as exc:
            raise ValueError(f"service account {service_account}: ca.crt: {exc}") from exc
        namespace_path = service_account / "namespace"
        namespace = namespace_path.read_text().strip() if namespace_path.exists() else "default"
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return KubeConfig(server, namespace, ssl_context=context,
                          credentials=TokenFile(token_path, max_age=token_max_age))
    path = env.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
    if Path(path).exists():
        return _from_kubeconfig(Path(path), token_max_age)
    raise ValueError("Kubernetes discovery needs a cluster: not running in one (no service account) and no "
                     "kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config); or give --endpoints instead")


def _named(items: Any, name: str, what: str, path: Path) -> dict[str, Any]:
    for item in items or ():
        if isinstance(item, dict) and item.get("name") == name:
            entry = item.get(what) or {}
            if not isinstance(entry, dict):
                raise ValueError(f"kubeconfig {path}: {what} {name!r} is not a mapping")
            return dict(entry)
    raise ValueError(f"kubeconfig {path}: no {what} named {name!r}")


def _from_kubeconfig(path: Path, token_max_age: float) -> KubeConfig:
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
    user_name = str(context.get("user") or "")
    user = _named(data.get("users"), user_name, "user", path) if user_name else {}
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise ValueError(f"kubeconfig {path}: cluster server {server!r} is not an http(s) URL")
    token, credentials = _user_credentials(user, f"kubeconfig {path}: user {user_name!r}", path.parent,
                                           token_max_age)
    try:
        ssl_context = _ssl_context(cluster, user, path.parent) if server.startswith("https://") else None
    except OSError as exc:  # ssl.SSLError is one: a missing or unreadable CA, certificate or key
        raise ValueError(f"kubeconfig {path}: TLS material: {exc}") from exc
    return KubeConfig(server, str(context.get("namespace") or "default"), token, ssl_context, credentials)


def _user_credentials(user: Mapping[str, Any], who: str, base: Path,
                      token_max_age: float) -> tuple[str, Credentials | None]:
    """(fixed token, token source) for a kubeconfig user; tokenFile wins over token, as in kubectl."""
    for key, mechanism in _UNSUPPORTED_USER_KEYS.items():
        if user.get(key):
            raise ValueError(f"{who} authenticates with {mechanism}, which picker does not support; use a "
                             "token, tokenFile, client certificate or exec credential plugin")
    if user.get("tokenFile"):
        return "", TokenFile(base / str(user["tokenFile"]), max_age=token_max_age)
    if user.get("token"):
        return str(user["token"]), None
    if user.get("exec"):
        return "", ExecCredentials(_exec_plugin(user["exec"], who, base))
    provider = user.get("auth-provider")
    if provider:
        name = provider.get("name") if isinstance(provider, dict) else None
        config = provider.get("config") if isinstance(provider, dict) else None
        id_token = config.get("id-token") if isinstance(config, dict) else None
        if name == "oidc" and isinstance(id_token, str) and id_token:
            log.warning("%s: using the OIDC id-token written in the kubeconfig as is; picker does not "
                        "refresh it (an exec plugin such as kubelogin would)", who)
            return id_token, None
        raise ValueError(f"{who} authenticates with auth-provider {name!r}, which picker does not support "
                         "(of auth providers only an OIDC id-token already in the kubeconfig is used); "
                         "switch the user to an exec credential plugin or a token")
    return "", None


def _exec_plugin(spec: Any, who: str, base: Path) -> ExecPlugin:
    """The `exec` stanza, checked now: a plugin that cannot run should stop start-up, not every request."""
    if not isinstance(spec, dict) or not isinstance(spec.get("command"), str) or not spec["command"]:
        raise ValueError(f"{who}: exec credential plugin has no command")
    version = spec.get("apiVersion")
    if version not in EXEC_API_VERSIONS:
        raise ValueError(f"{who}: exec credential plugin apiVersion {version!r} is not supported (only "
                         f"{' and '.join(EXEC_API_VERSIONS)})")
    if spec.get("interactiveMode") == "Always":
        raise ValueError(f"{who}: exec credential plugin wants interactiveMode Always, but picker runs "
                         "unattended (no terminal)")
    command = spec["command"]
    if os.sep in command and not os.path.isabs(command):
        command = str(base / command)  # relative to the kubeconfig, as kubectl resolves it
    found = shutil.which(command)
    if found is None:
        hint = spec.get("installHint")
        raise ValueError(f"{who}: exec credential plugin {command!r} is not installed or not executable"
                         + (f" ({str(hint).strip()})" if hint else ""))
    args = spec.get("args") or []
    env = spec.get("env") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{who}: exec credential plugin args must be a list of strings")
    if not isinstance(env, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                            for e in env):
        raise ValueError(f"{who}: exec credential plugin env must be a list of {{name, value}}")
    return ExecPlugin(found, tuple(args), tuple((e["name"], str(e.get("value") or "")) for e in env), version)


def _material(entry: Mapping[str, Any], key: str, base: Path, temp: list[str]) -> str | None:
    """A file path for `key` (relative to the kubeconfig) or `key-data` (base64, written to a temp file)."""
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
