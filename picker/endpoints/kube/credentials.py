"""Where the API server's bearer token comes from, asked again before every request.

A long-running picker cannot read its token once: the kubelet rewrites a pod's projected (bound, expiring)
service-account token about hourly, and cloud kubeconfigs mint short-lived tokens through an exec credential
plugin. So the REST client asks its `Credentials` for the token at each request and calls `invalidate()` after
a 401, so that the one retry carries a fresh token:

- `StaticToken`: a kubeconfig `token` (or an OIDC `id-token`), or none (client certificates, plain HTTP).
- `TokenFile`: re-read when the copy in hand is older than `max_age` (60 s, about as often as client-go) or
  after a 401; used for the in-cluster service account and a kubeconfig `tokenFile`. An unreadable file keeps
  the last good token (the kubelet swaps the file atomically, but a read can still race a remount).
- `ExecCredentials`: a client.authentication.k8s.io/v1 or v1beta1 ExecCredential plugin, run with its args and
  env as an asyncio subprocess (never blocking the event loop), its `status.token` cached until
  `status.expirationTimestamp` (less `margin`), or without one until a 401.

A token that cannot be had raises `CredentialsError`; the REST client reports it as a KubeError, which the
discovery loops retry with backoff (a plugin's identity provider may be briefly unreachable).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKEN_MAX_AGE = 60.0  # seconds a token file's content is trusted before it is read again
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


class CredentialsError(Exception):
    """No token could be had: the token file is unreadable or the exec plugin failed."""


class Credentials:
    """A bearer-token source ("" means: send no Authorization header)."""

    async def token(self) -> str:
        return ""

    def invalidate(self, refused: str) -> None:
        """The server refused `refused` (401): if it is still the token in hand, do not hand it out again.
        (A 401 for a token already replaced, by a concurrent request's retry, must not fetch yet another.)"""


class StaticToken(Credentials):
    def __init__(self, token: str = "") -> None:
        self._token = token

    async def token(self) -> str:
        return self._token


class TokenFile(Credentials):
    """A token file read again once `max_age` seconds old, or after `invalidate()`."""

    def __init__(self, path: Path, *, max_age: float = TOKEN_MAX_AGE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.max_age = max_age
        self._clock = clock
        self._token = ""
        self._read_at = -math.inf

    async def token(self) -> str:
        now = self._clock()
        if self._token and now - self._read_at < self.max_age:
            return self._token
        try:
            token = (await asyncio.to_thread(self.path.read_text)).strip()
            if not token:
                raise CredentialsError(f"token file {self.path} is empty")
        except (OSError, UnicodeDecodeError, CredentialsError) as exc:
            if not self._token:
                raise CredentialsError(f"token file {self.path}: {exc}") from exc
            log.warning("token file %s: %s; keeping the token read before", self.path, exc)
            token = self._token
        if token != self._token and self._token:
            log.info("token file %s: a new token (rotated)", self.path)
        self._token, self._read_at = token, now
        return token

    def invalidate(self, refused: str) -> None:
        if refused == self._token:
            self._read_at = -math.inf


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig user's `exec` stanza: what to run and which ExecCredential version it speaks."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = EXEC_API_VERSIONS[0]


class ExecCredentials(Credentials):
    """Tokens from an exec credential plugin, re-run on expiry (less `margin` s) or after a 401."""

    def __init__(self, plugin: ExecPlugin, *, clock: Callable[[], float] = time.time, timeout: float = 60.0,
                 margin: float = 10.0) -> None:
        self.plugin = plugin
        self.timeout = timeout
        self.margin = margin
        self.runs = 0
        self._clock = clock
        self._token = ""
        self._expires: float | None = None
        self._refused = False
        self._lock = asyncio.Lock()  # concurrent requests share one plugin run

    def _fresh(self) -> bool:
        if not self._token or self._refused:
            return False
        return self._expires is None or self._clock() < self._expires - self.margin

    async def token(self) -> str:
        if self._fresh():
            return self._token
        async with self._lock:
            if not self._fresh():
                self._token, self._expires = await self._run()
                self._refused = False
        return self._token

    def invalidate(self, refused: str) -> None:
        if refused == self._token:
            self._refused = True

    async def _run(self) -> tuple[str, float | None]:
        plugin = self.plugin
        info = {"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": json.dumps(info)}
        self.runs += 1
        try:
            process = await asyncio.create_subprocess_exec(
                plugin.command, *plugin.args, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise CredentialsError(f"exec credential plugin {plugin.command!r}: {exc}") from exc
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), self.timeout)
        except TimeoutError:
            raise CredentialsError(f"exec credential plugin {plugin.command!r}: no answer in "
                                   f"{self.timeout:g}s") from None
        finally:
            if process.returncode is None:  # timed out or cancelled: do not leave it running
                process.kill()
                await asyncio.shield(process.wait())
        if process.returncode != 0:
            tail = stderr.decode(errors="replace").strip()[-300:]
            raise CredentialsError(f"exec credential plugin {plugin.command!r} exited with "
                                   f"{process.returncode}" + (f": {tail}" if tail else ""))
        token, expires = parse_exec_credential(stdout, plugin.api_version)
        log.debug("exec credential plugin %r: a token%s", plugin.command,
                  "" if expires is None else f" valid for {expires - self._clock():.0f}s")
        return token, expires


def parse_exec_credential(output: bytes, api_version: str) -> tuple[str, float | None]:
    """An ExecCredential's `status.token` and `status.expirationTimestamp` (epoch seconds, None if absent)."""
    try:
        data: Any = json.loads(output)
    except ValueError:
        raise CredentialsError("exec credential plugin printed no JSON ExecCredential") from None
    if not isinstance(data, dict) or data.get("kind") != "ExecCredential":
        raise CredentialsError("exec credential plugin printed something other than an ExecCredential")
    if data.get("apiVersion") != api_version:
        raise CredentialsError(f"exec credential plugin answered in {data.get('apiVersion')!r}, asked for "
                               f"{api_version!r}")
    status = data.get("status")
    if not isinstance(status, dict):
        raise CredentialsError("exec credential plugin's ExecCredential has no status")
    token = status.get("token")
    if not isinstance(token, str) or not token:
        if status.get("clientCertificateData"):
            raise CredentialsError("exec credential plugin returned a client certificate; picker supports "
                                   "only plugins that return a token")
        raise CredentialsError("exec credential plugin's ExecCredential has no status.token")
    stamp = status.get("expirationTimestamp")
    if stamp is None:
        return token, None
    try:
        moment = datetime.fromisoformat(str(stamp))
    except ValueError:
        raise CredentialsError(f"exec credential plugin: expirationTimestamp {stamp!r} is not RFC 3339"
                               ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return token, moment.timestamp()
