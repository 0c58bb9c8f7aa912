"""What each pod lists at `GET /v1/models`: its base model and every LoRA adapter it has loaded, idle or not.

A pod's metrics name only the adapters running or waiting at that moment (`vllm:lora_requests_info`), so an
adapter loaded on one pod but idle looks as if no pod had it, and the request would go to a pod that must load
it first. The listing closes that gap. It is cheap for a pod (a short JSON list, no metrics rendering) and it
changes only when an adapter is loaded or unloaded, so it is read rarely: every `interval` seconds (default 30;
one request per pod per replica, against the scraper's one or more per second), at once for a pod that joins,
and within about a second for a pod whose metrics name other base models than when it was read (a model swap:
until then its listing is not believed, `Endpoint.listing`).
A listing that fails (an API key in front of `/v1/models`, a pod that does not serve it) keeps the last one read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable

import aiohttp

from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"  # OpenAI's model list: read of pods here, answered for the pool by the director
MAX_LISTED = 1024  # ids kept per pod: more is no model server's listing
MAX_ID_CHARS = 512
RECHECK_S = 1.0  # how often pods are checked for a model swap their metrics show


def listed_models(body: bytes) -> frozenset[str] | None:
    """The ids of OpenAI's `{"object": "list", "data": [{"id": ...}, ...]}`; None if the body is not that."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None
    ids = (item.get("id") for item in items[:MAX_LISTED] if isinstance(item, dict))
    return frozenset(i for i in ids if isinstance(i, str) and 0 < len(i) <= MAX_ID_CHARS)


class ModelListings:
    """Reads every pod's `/v1/models` into `Endpoint.listed_models`, each pod on its own timer."""

    def __init__(self, endpoints_fn: Callable[[], Iterable[Endpoint]], *, interval: float = 30.0,
                 timeout: float = 2.0, scheme: str = "http", verify_tls: bool = False,
                 session: aiohttp.ClientSession | None = None) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        self.endpoints_fn = endpoints_fn
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.scheme = scheme
        self.verify_tls = verify_tls
        self._session = session
        self._owns_session = session is None
        self._read_at: dict[str, float] = {}  # address -> loop time of its last attempt
        self._failing: set[str] = set()  # addresses whose last attempt failed (logged once per outage)
        self._wakeup = asyncio.Event()

    def pod_joined(self) -> None:
        """A pod joined (or came back): read its listing now rather than at the next round."""
        self._wakeup.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=self.verify_tls))
        try:
            while True:
                now = loop.time()
                due = [e for e in self.endpoints_fn() if self._due(e, now)]
                if due:
                    await asyncio.gather(*(self.read(e) for e in due))
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self._until_next(loop.time()))
        finally:
            if self._owns_session and self._session is not None:
                await self._session.close()
                self._session = None

    def _due(self, endpoint: Endpoint, now: float) -> bool:
        """Its round has come, or its metrics name other base models than when it was read (checked each
        `RECHECK_S`: a pod that swapped its model is re-read within about a second)."""
        since = now - self._read_at.get(endpoint.address, -float("inf"))
        return since >= self.interval or (since >= RECHECK_S and endpoint.listed_for != endpoint.metrics.models)

    def _until_next(self, now: float) -> float:
        addresses = {e.address for e in self.endpoints_fn()}
        for gone in set(self._read_at) - addresses:
            del self._read_at[gone]
            self._failing.discard(gone)
        pending = [self._read_at.get(a, -float("inf")) + self.interval - now for a in addresses]
        return max(0.05, min(*pending, RECHECK_S, self.interval))

    async def read(self, endpoint: Endpoint) -> bool:
        """One read of one pod's listing; True when it was read and understood."""
        assert self._session is not None, "run() opens the session"
        self._read_at[endpoint.address] = asyncio.get_running_loop().time()
        url = f"{self.scheme}://{endpoint.destination}{MODELS_PATH}"  # a rank: its server's listing
        try:
            async with self._session.get(url, timeout=self.timeout) as response:
                body = await response.read() if response.status == 200 else b""
                problem = f"HTTP {response.status}" if response.status != 200 else ""
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            body, problem = b"", str(exc) or type(exc).__name__
        models = listed_models(body) if body else None
        if models is None:
            if endpoint.address not in self._failing:
                self._failing.add(endpoint.address)
                log.info("%s: %s unreadable (%s); its metrics alone tell what it serves", endpoint.address,
                         MODELS_PATH, problem or "not a model list")
            return False
        self._failing.discard(endpoint.address)
        if models != endpoint.listed_models:
            log.info("%s lists %s", endpoint.address, ", ".join(sorted(models)) or "no model")
        endpoint.listed_models, endpoint.listed_for = models, endpoint.metrics.models
        return True
