"""The API server's REST interface as discovery uses it: GET an object, LIST a collection, WATCH it.

Every request asks the config's `Credentials` for the current token; a 401 invalidates it and the request is
sent once more if that yields a different token (a rotated file, a re-run exec plugin).

Errors are typed so the loops above can tell what to retry. What the client raises is a `KubeError` (the
server refused the call, answered something that is not JSON, or no token could be had), `Gone` (410: the
resourceVersion is too old, list again) or an aiohttp/timeout/connection error: together `TRANSIENT`. A single
malformed object (no metadata or name, not a mapping) in a list or a watch is logged and skipped, and a watch
goes on past it; anything else escaping a caller is a bug, not to be retried as if the network had failed.
Watch lines are split here rather than by aiohttp's readline, whose line limit a large pod object can exceed.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from picker.endpoints.kube.credentials import CredentialsError
from picker.endpoints.kube.kubeconfig import KubeConfig

log = logging.getLogger(__name__)

WATCH_TIMEOUT_SECONDS = 300  # the API server closes each watch after this; we re-watch from the last version
MAX_EVENT_BYTES = 32 * 2**20  # one watch event (one object) larger than this is a broken stream
_EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")


class KubeError(Exception):
    """The API server refused a call (status and its message), answered garbage (status 0), or no token could
    be had. `retry_after` is the server's Retry-After in seconds (429, 503), else 0."""

    def __init__(self, status: int, message: str, *, retry_after: float = 0.0) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.retry_after = retry_after


class Gone(KubeError):
    """The resourceVersion we watch from is too old (HTTP 410, or a watch ERROR with code 410): list again."""

    def __init__(self, message: str = "resourceVersion too old") -> None:
        super().__init__(410, message)


# What a discovery loop retries with backoff; anything else is a bug and propagates.
TRANSIENT: tuple[type[BaseException], ...] = (KubeError, aiohttp.ClientError, TimeoutError, ConnectionError)


@dataclass(frozen=True)
class WatchEvent:
    """One usable watch event. A BOOKMARK (or a skipped malformed object) only moves `version` on."""

    type: str  # ADDED, MODIFIED, DELETED or BOOKMARK
    name: str  # metadata.name ("" for a bookmark)
    object: dict[str, Any]
    version: str  # metadata.resourceVersion ("" when absent)


class KubeApi:
    """The few REST calls discovery makes, on one lazily opened HTTP session."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        self.credentials = config.auth()
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context or False) \
                if self.config.server.startswith("https://") else aiohttp.TCPConnector()
            timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=WATCH_TIMEOUT_SECONDS + 30)
            self._session = aiohttp.ClientSession(self.config.server, headers={"Accept": "application/json"},
                                                  connector=connector, timeout=timeout)
        return self._session

    async def _token(self) -> str:
        try:
            return await self.credentials.token()
        except CredentialsError as exc:
            raise KubeError(0, f"credentials: {exc}") from exc

    @contextlib.asynccontextmanager
    async def _open(self, path: str,
                    params: Mapping[str, str] | None) -> AsyncIterator[aiohttp.ClientResponse]:
        """A 200 response to GET `path` (its body unread); a 401 is retried once with a fresh token."""
        token = await self._token()
        for attempt in range(2):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with self._client().get(path, params=params, headers=headers) as response:
                if response.status == 401 and attempt == 0:
                    self.credentials.invalidate(token)
                    fresh = await self._token()
                    if fresh != token:
                        log.info("API server refused the token (401): retrying with a fresh one")
                        token = fresh
                        continue
                if response.status != 200:
                    raise _error(response.status, await response.read(), response.headers.get("Retry-After"))
                yield response
                return

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        async with self._open(path, params) as response:
            body = await response.read()
        try:
            data = json.loads(body)
        except ValueError:
            raise KubeError(0, f"GET {path}: the answer is not JSON") from None
        if not isinstance(data, dict):
            raise KubeError(0, f"GET {path}: the answer is not a JSON object")
        return data

    async def list(self, path: str, params: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], str]:
        """The collection's objects by name and the list's resourceVersion (to watch from)."""
        data = await self.get(path, params)
        items = data.get("items")
        if items is None:
            items = []
        if not isinstance(items, list):
            raise KubeError(0, f"LIST {path}: items is not a list")
        objects: dict[str, dict[str, Any]] = {}
        for item in items:
            name = _name(item)
            if name is None:
                log.warning("LIST %s: skipping a malformed object: %.200r", path, item)
                continue
            objects[name] = item
        meta = data.get("metadata")
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return objects, version if isinstance(version, str) else ""

    async def watch(self, path: str, params: Mapping[str, str],
                    version: str) -> AsyncGenerator[WatchEvent, None]:
        """Events after `version` until the server ends the stream. A watch ERROR raises (`Gone` for 410)."""
        query = {**params, "watch": "true", "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(WATCH_TIMEOUT_SECONDS)}
        if version:
            query["resourceVersion"] = version
        async with self._open(path, query) as response:
            async for line in _lines(response.content):
                event = _event(line, path)
                if event is not None:
                    yield event

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _error(status: int, body: bytes, retry_after: str | None) -> KubeError:
    message = body[:200].decode(errors="replace")
    with contextlib.suppress(ValueError):
        data = json.loads(body)
        if isinstance(data, dict) and data.get("message"):
            message = str(data["message"])
    seconds = float(retry_after) if retry_after and retry_after.strip().isdigit() else 0.0
    return Gone(message) if status == 410 else KubeError(status, message, retry_after=seconds)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Non-blank newline-separated lines of a watch stream, however long."""
    buffer = bytearray()
    scanned = 0
    async for chunk in content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n", scanned)) >= 0:
            line = bytes(buffer[:end])
            del buffer[:end + 1]
            scanned = 0
            if line.strip():
                yield line
        scanned = len(buffer)
        if scanned > MAX_EVENT_BYTES:
            raise KubeError(0, f"a watch event is larger than {MAX_EVENT_BYTES} bytes")
    if bytes(buffer).strip():
        yield bytes(buffer)


def _name(obj: Any) -> str | None:
    """metadata.name of a well-formed object, else None."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def _event(line: bytes, path: str) -> WatchEvent | None:
    try:
        event = json.loads(line)
    except ValueError:
        raise KubeError(0, f"watch {path}: a line is not JSON (a broken stream)") from None
    kind = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if kind == "ERROR":
        status = obj if isinstance(obj, dict) else {}
        code = status.get("code")
        message = str(status.get("message") or "watch error")
        if code == 410:
            raise Gone(message)
        raise KubeError(code if isinstance(code, int) else 0, message)
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    version = version if isinstance(version, str) else ""
    if kind == "BOOKMARK" and isinstance(obj, dict):
        return WatchEvent("BOOKMARK", "", obj, version)
    name = _name(obj)
    if kind not in _EVENT_TYPES or name is None or not isinstance(obj, dict):
        log.warning("watch %s: skipping a malformed event: %.200r", path, event)
        return WatchEvent("BOOKMARK", "", {}, version) if version else None
    return WatchEvent(str(kind), name, obj, version)
