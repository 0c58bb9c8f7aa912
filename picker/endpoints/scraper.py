"""Polls every endpoint's vLLM /metrics on a fixed cadence and keeps Endpoint.metrics and health current.

Each endpoint is scraped on its own task, so a pod that hangs until the timeout never delays the others'
refresh; a pod is not scraped again while its previous scrape is still running. After
`failure_threshold` consecutive failed polls the pod is marked unhealthy (and `on_unhealthy` runs, e.g. to
drop it from the ready list); the first successful poll restores it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp

from picker.endpoints.metrics import parse_vllm_metrics
from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)

EndpointCallback = Callable[[Endpoint], None]


class MetricsScraper:
    def __init__(
        self,
        endpoints_fn: Callable[[], Iterable[Endpoint]],
        *,
        refresh_interval: float = 0.05,
        timeout: float = 0.5,
        failure_threshold: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_unhealthy: EndpointCallback | None = None,
        on_healthy: EndpointCallback | None = None,
        session: aiohttp.ClientSession | None = None,
        path: str = "/metrics",
    ) -> None:
        if refresh_interval <= 0 or timeout <= 0 or failure_threshold <= 0:
            raise ValueError("refresh_interval, timeout and failure_threshold must be positive")
        self.endpoints_fn = endpoints_fn
        self.refresh_interval = refresh_interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.failure_threshold = failure_threshold
        self.clock = clock
        self.on_unhealthy = on_unhealthy
        self.on_healthy = on_healthy
        self.path = path
        self._session = session
        self._owns_session = session is None
        self._inflight: dict[str, asyncio.Task[bool]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self.polls = 0  # scrape attempts, for tests and our own metrics
        self.failures = 0

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection cap: one keep-alive connection per pod, however many pods there are.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def start(self) -> None:
        """Begin polling in the background (idempotent)."""
        self._ensure_session()
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="metrics-scraper")

    async def stop(self) -> None:
        """Stop polling, cancel scrapes in flight, close the session if we opened it."""
        tasks = [t for t in (self._loop_task, *self._inflight.values()) if t is not None]
        self._loop_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._inflight.clear()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            self._launch()
            next_tick += self.refresh_interval
            delay = next_tick - loop.time()
            if delay < 0:  # fell behind (a stalled loop): skip missed ticks rather than burst
                next_tick = loop.time()
                delay = 0
            await asyncio.sleep(delay)

    def _launch(self) -> list[asyncio.Task[bool]]:
        started = []
        for endpoint in self.endpoints_fn():
            if endpoint.address in self._inflight:
                continue
            task = asyncio.create_task(self.scrape(endpoint))
            self._inflight[endpoint.address] = task
            task.add_done_callback(functools.partial(self._done, endpoint.address))
            started.append(task)
        return started

    def _done(self, address: str, task: asyncio.Task[bool]) -> None:
        if self._inflight.get(address) is task:
            del self._inflight[address]

    async def poll_once(self) -> None:
        """One poll of every current endpoint, waiting for all of them (tests, start-up warm-up)."""
        self._ensure_session()
        pending = [*self._launch()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def scrape(self, endpoint: Endpoint) -> bool:
        """Scrape one endpoint and update its metrics and health; True on success."""
        session = self._ensure_session()
        self.polls += 1
        url = f"http://{endpoint.address}{self.path}"
        try:
            async with session.get(url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                body = await resp.read()
            metrics = parse_vllm_metrics(body.decode("utf-8", "replace"), updated_at=self.clock())
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            self._failed(endpoint, exc)
            return False
        endpoint.metrics = metrics
        endpoint.consecutive_failures = 0
        if not endpoint.healthy:
            endpoint.healthy = True
            log.info("endpoint %s healthy again", endpoint.address)
            if self.on_healthy is not None:
                self.on_healthy(endpoint)
        return True

    def _failed(self, endpoint: Endpoint, exc: BaseException) -> None:
        self.failures += 1
        endpoint.consecutive_failures += 1
        if endpoint.healthy and endpoint.consecutive_failures >= self.failure_threshold:
            endpoint.healthy = False
            log.warning(
                "endpoint %s unhealthy after %d failed polls: %s",
                endpoint.address, endpoint.consecutive_failures, exc.__class__.__name__,
            )
            if self.on_unhealthy is not None:
                self.on_unhealthy(endpoint)
