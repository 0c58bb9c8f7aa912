"""Polls every endpoint's vLLM /metrics and keeps Endpoint.metrics and health current, on a per-pod cadence.

A scrape is not free for the pod: vLLM renders /metrics (~50 KB) in its API server, the event loop that also
streams every token (bench/scrape_cost.py measures it). Our own in-flight accounting is the fast signal; the
scrape corrects it. So by default (`Cadence()`) a pod is scraped every `slow` seconds while it is calm and every
`fast` seconds while it is near saturation (waiting requests, KV cache filling), while it runs more requests
than we routed to it (traffic that bypasses us), or after a failed scrape. A fixed cadence (GIE's
`--refresh-metrics-interval`) is `Cadence.fixed(interval)`.

Each endpoint is scraped on its own task, so a pod that hangs until the timeout never delays the others'
refresh; a pod is not scraped again while its previous scrape is still running. After
`failure_threshold` consecutive failed polls the scraper tries the pod's serving port: a pod that accepts a
connection there is only degraded (its metrics cannot be read; it stays routable on the picker's own view, and is
scraped at the slow cadence), one that does not is unready. The first successful poll makes it ready again. The
scraper asks its `health` owner (the endpoint pool) for each change and never flips state itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import math
import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from yarl import URL

from picker.core.lifecycle import cancel_all
from picker.endpoints.metrics import VLLM_FILTER_MARK, VLLM_READ_SERIES, parse_metrics
from picker.endpoints.pool import PoolEvent, PoolListener
from picker.endpoints.shared_scrape import SharedScrapes, grace
from picker.endpoints.state import Endpoint, EndpointMetrics, EndpointState


class HealthTransitions(Protocol):
    """Who owns endpoint health (EndpointPool): the scraper reports, the owner changes state and tells listeners."""

    def mark_unready(self, endpoint: Endpoint, reason: str = "") -> None: ...

    def mark_degraded(self, endpoint: Endpoint, reason: str = "") -> None: ...

    def mark_ready(self, endpoint: Endpoint, reason: str = "") -> None: ...

    def mark_restarted(self, endpoint: Endpoint, reason: str = "") -> None: ...

    def metrics_read(self, endpoint: Endpoint) -> None:
        """`endpoint.metrics` was just replaced: the owner may split it among the server's data-parallel ranks."""


Reachable = Callable[[Endpoint], Awaitable[bool]]

def started_over(before: EndpointMetrics, after: EndpointMetrics) -> str:
    """Why a pod restarted between two scrapes of it ("" when it did not): a counter vLLM only ever increases
    while it runs went down. Only a later reading counts (another replica's older record may come after ours)."""
    if before.updated_at < 0 or after.updated_at <= before.updated_at:
        return ""
    for name, was, now in (("prefix cache queries", before.prefix_queries, after.prefix_queries),
                           ("finished prompts", before.prompt_count, after.prompt_count),
                           ("first tokens", before.ttft_count, after.ttft_count)):
        if now < was:
            return f"its {name} went from {was:g} to {now:g}"
    return ""


async def serving_port_open(endpoint: Endpoint, connect_s: float) -> bool:
    """Whether the pod accepts a TCP connection on its serving port (what Envoy would send the request to)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(endpoint.ip, endpoint.port), connect_s)
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True

ScrapeCallback = Callable[[Endpoint, bool, bool], None]  # endpoint, fetched and read, fetched but unreadable
log = logging.getLogger(__name__)
# prometheus_client's filter: only the samples named (`name[]=...`), as its exposition app takes them
_FILTER_QUERY = urllib.parse.urlencode([("name[]", series) for series in VLLM_READ_SERIES])
FIRST_SCRAPES = 64  # pods that may join in one sweep and be scraped at once; more are spread out


@dataclass(frozen=True, slots=True)
class Cadence:
    """How often one pod is scraped; `fast == slow` is a fixed cadence."""

    fast: float = 0.1
    slow: float = 1.0
    busy_waiting: float = 1.0  # waiting requests at which a pod is near saturation
    busy_kv: float = 0.7  # KV-cache utilisation at which a pod is near saturation
    unseen_requests: int = 2  # requests a pod runs beyond those we routed to it that count as disagreement
    # Our in-flight count is all of the pod's traffic only when we are its only router; replicas that share
    # scrapes each see a part, so they cannot use that rule.
    compare_in_flight: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.fast <= self.slow:
            raise ValueError("cadence needs 0 < fast <= slow")

    @classmethod
    def fixed(cls, interval: float) -> Cadence:
        return cls(fast=interval, slow=interval)

    def interval(self, endpoint: Endpoint, ok: bool) -> float:
        """Seconds until this pod's next scrape, given the scrape that just ended."""
        if not ok:  # a degraded pod is not hammered for metrics it will not give
            return self.slow if endpoint.state is EndpointState.DEGRADED else self.fast
        if self.fast == self.slow:
            return self.fast
        m = endpoint.metrics
        if m.waiting >= self.busy_waiting or m.kv_usage >= self.busy_kv:
            return self.fast
        if self.compare_in_flight and m.running + m.waiting - endpoint.in_flight >= self.unseen_requests:
            return self.fast
        return self.slow


@dataclass(frozen=True, slots=True)
class MetricsTarget:
    """Where a pod's metrics are read (the reference picker's --model-server-metrics-* flags): scheme, a port
    shared by every pod (0: the pod's serving port) and path; and whether to ask for only the series we read."""

    scheme: str = "http"
    port: int = 0
    path: str = "/metrics"
    verify_tls: bool = False  # https only: GIE's --model-server-metrics-https-insecure-skip-verify defaults true
    only_read_series: bool = True

    def url(self, endpoint: Endpoint) -> str:
        if not self.port:
            host = endpoint.address
        else:
            host = f"[{endpoint.ip}]:{self.port}" if ":" in endpoint.ip else f"{endpoint.ip}:{self.port}"
        return f"{self.scheme}://{host}{self.path}"

    def filtered_url(self, endpoint: Endpoint) -> str | None:
        """The page with only vLLM's series we read (None when off). vLLM 0.32 takes the filter at `/metrics/`,
        its Prometheus client's own mount; its `/metrics` route answers the whole page whatever the query."""
        if not self.only_read_series:
            return None
        slash = "" if self.path.endswith("/") else "/"
        return f"{self.url(endpoint)}{slash}?{_FILTER_QUERY}"


class MetricsScraper:
    def __init__(
        self,
        endpoints_fn: Callable[[], Iterable[Endpoint]],
        *,
        refresh_interval: float | None = None,
        cadence: Cadence | None = None,
        timeout: float = 0.5,
        failure_threshold: int = 2,
        clock: Callable[[], float] = time.monotonic,
        health: HealthTransitions | None = None,
        on_scrape: ScrapeCallback | None = None,
        session: aiohttp.ClientSession | None = None,
        target: MetricsTarget | None = None,
        shared: SharedScrapes | None = None,
        on_metrics: Callable[[Endpoint], None] | None = None,
        reachable: Reachable | None = None,
        max_rate: float = 0.0,
        subscribe: Callable[[PoolListener], None] | None = None,
    ) -> None:
        """`refresh_interval` (a fixed cadence) and `cadence` exclude each other; neither: `Cadence()`.
        With `shared`, replicas take turns scraping each pod and the others read the result. `on_metrics` hears
        of every pod whose metrics were refreshed (our scrape or a shared record): room may have freed.
        `reachable` tells a degraded pod from an unready one (default: a TCP connection to its serving port).
        `max_rate` (> 0) caps the pool's scrapes a second: when the pods' cadences ask for more, every interval
        stretches by the same factor (a large pool of busy pods would otherwise cost the picker a core).
        `subscribe` (the pool's): pods joining or leaving wake the loop to read the pool; without it the pool is read
        every `fast` seconds, ten wake-ups a second that cost an idle picker a third of its CPU."""
        if refresh_interval is not None and cadence is not None:
            raise ValueError("give refresh_interval or cadence, not both")
        if (refresh_interval is not None and refresh_interval <= 0) or timeout <= 0 or failure_threshold <= 0:
            raise ValueError("refresh_interval, timeout and failure_threshold must be positive")
        self.endpoints_fn = endpoints_fn
        self.cadence = Cadence.fixed(refresh_interval) if refresh_interval is not None else (cadence or Cadence())
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.failure_threshold = failure_threshold
        self.clock = clock
        self.health = health
        self.on_scrape = on_scrape
        self.target = target if target is not None else MetricsTarget()
        self.shared = shared
        self.on_metrics = on_metrics
        self.reachable = reachable if reachable is not None else functools.partial(serving_port_open, connect_s=timeout)
        self._applied: dict[str, float] = {}  # address -> time of the last shared record applied
        # address -> loop time until which this replica holds the pod's shared-scrape lease (it scrapes the pod,
        # so it renews the lease without reading the record it wrote itself)
        self._leased: dict[str, float] = {}
        self._session = session
        self._owns_session = session is None
        self._inflight: dict[str, asyncio.Task[bool]] = {}
        self._due: dict[str, float] = {}  # address -> loop time of its next scrape
        # (due, address) of every pod's next scrape, soonest first; an entry whose time is no longer its pod's
        # `_due` (rescheduled, or the pod left) is skipped when it comes up
        self._queue: list[tuple[float, str]] = []
        self._known: dict[str, Endpoint] = {}  # the pool as of the last sweep, by address
        self._next_sweep = 0.0  # loop time at which the pool is read again for pods that joined or left
        self._wake_at = 0.0  # loop time the loop's timer is set for
        self.max_rate = max_rate
        self._rates: dict[str, float] = {}  # address -> 1 / its cadence's interval: scrapes a second it asks for
        self._demand = 0.0  # their sum, kept as each changes
        self._urls: dict[str, URL] = {}  # address -> its metrics URL
        # pods whose page did not take the series filter (not vLLM, an exporter without it): read whole
        self._whole_page: set[str] = set()
        self._rng = random.Random()  # spreads each pod's next scrape a little, so a pool's scrapes do not bunch
        self._wakeup: asyncio.Future[None] | None = None  # the loop's sleep; an earlier due scrape ends it
        self._loop_task: asyncio.Task[None] | None = None
        self.polls = 0  # scrape attempts, for tests and our own metrics
        self.failures = 0
        self._sweep_every = math.inf if subscribe is not None else self.cadence.fast
        if subscribe is not None:
            subscribe(self._membership_changed)

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection cap: one keep-alive connection per pod, however many pods there are.
            verify = self.target.scheme == "https" and self.target.verify_tls
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=verify))  # True: the system trust store
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
        await cancel_all(tasks)
        self._inflight.clear()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        """Start the scrapes that are due, then sleep until the next one is. The pool is read at most every `fast`
        seconds (pods that joined are scraped at once); in between, a wake-up costs only the scrapes it starts, so
        a pool of thousands of pods is not walked once per finished scrape."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if now >= self._next_sweep:
                self._sweep(now)
                self._next_sweep = now + self._sweep_every
            self._launch_due(now)
            wake = min(self._queue[0][0], self._next_sweep) if self._queue else self._next_sweep
            # A plain future woken by a timer, a sooner scrape or a pod joining or leaving. Not
            # wait_for(event.wait()): on Python 3.11 that can swallow a cancellation that lands as the event fires,
            # and stop() would wait forever.
            self._wakeup = loop.create_future()
            self._wake_at = wake
            timer = loop.call_later(max(0.0, wake - now), self._wake) if wake < math.inf else None
            try:
                await self._wakeup
            finally:
                if timer is not None:
                    timer.cancel()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _membership_changed(self, event: PoolEvent, endpoint: Endpoint) -> None:
        if event is PoolEvent.ADDED or event is PoolEvent.REMOVED:
            self._next_sweep = 0.0
            self._wake()

    def _sweep(self, now: float) -> None:
        """Read the pool: pods not seen before are due now, or, when many join at once (start-up), one every
        `fast / FIRST_SCRAPES` seconds, so their scrapes stay spread out from then on; a pod that left is forgotten
        (its scrapes a second leave the demand `stretch` weighs against `max_rate`)."""
        known = {e.address: e for e in self.endpoints_fn()}
        joined = [address for address in known if address not in self._known and address not in self._due]
        spacing = self.cadence.fast / FIRST_SCRAPES if len(joined) > FIRST_SCRAPES else 0.0
        for i, address in enumerate(joined):
            self._schedule(address, now + i * spacing)
        for address in self._known.keys() - known.keys():
            self._due.pop(address, None)
            self._applied.pop(address, None)
            self._leased.pop(address, None)
            self._set_rate(address, None)
            self._urls.pop(address, None)
            self._whole_page.discard(address)
        self._known = known

    @property
    def stretch(self) -> float:
        """How much longer than their cadence asks the pods' intervals are (1: not at all), under `max_rate`."""
        return self._demand / self.max_rate if self.max_rate and self._demand > self.max_rate else 1.0

    def _paced(self, endpoint: Endpoint, ok: bool) -> float:
        """The pod's next interval: its cadence's, stretched while the pool asks for more than `max_rate`."""
        interval = self.cadence.interval(endpoint, ok)
        self._set_rate(endpoint.address, 1.0 / interval)
        endpoint.scrape_interval = interval * self.stretch
        return endpoint.scrape_interval

    def _set_rate(self, address: str, rate: float | None) -> None:
        """The scrapes a second `address` asks of us (None: none, it left or another replica scrapes it)."""
        old = self._rates.pop(address, 0.0) if rate is None else self._rates.get(address, 0.0)
        if rate is not None:
            self._rates[address] = rate
        self._demand += (rate or 0.0) - old

    def _schedule(self, address: str, due: float) -> None:
        self._due[address] = due
        heapq.heappush(self._queue, (due, address))
        if due < self._wake_at:
            self._wake()  # sooner than the loop's timer

    def _launch_due(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            due, address = heapq.heappop(queue)
            endpoint = self._known.get(address)
            if endpoint is None or self._due.get(address) != due or address in self._inflight:
                continue  # gone, rescheduled, or being scraped (it schedules its next scrape when it ends)
            self._start(endpoint)

    def _start(self, endpoint: Endpoint) -> asyncio.Task[bool]:
        task = asyncio.create_task(self._scrape_and_schedule(endpoint))
        self._inflight[endpoint.address] = task
        task.add_done_callback(functools.partial(self._done, endpoint.address))
        return task

    def _launch(self) -> list[asyncio.Task[bool]]:
        """Scrape every current endpoint that is not being scraped already (poll_once)."""
        return [self._start(e) for e in self.endpoints_fn() if e.address not in self._inflight]

    async def _scrape_and_schedule(self, endpoint: Endpoint) -> bool:
        start = asyncio.get_running_loop().time()
        ok, wait = False, self.cadence.fast  # what an unexpected error leaves: try again soon
        try:
            if self.shared is not None:
                ok, wait = await self._refresh_shared(endpoint, self.shared)
            else:
                ok = await self.scrape(endpoint)
                wait = self._paced(endpoint, ok)
        finally:
            address = endpoint.address
            if self._inflight.get(address) is asyncio.current_task():
                del self._inflight[address]  # done: its next scrape may start (`_done` covers a cancelled one)
            if address in self._known or self._loop_task is None:
                # +-5 %: pods scraped together (all of them at start-up) drift apart instead of staying in one burst
                self._schedule(address, start + wait * self._rng.uniform(0.95, 1.05))
        return ok

    async def _refresh_shared(self, endpoint: Endpoint, shared: SharedScrapes) -> tuple[bool, float]:
        """Read the pod's shared record; scrape it only when no other replica is keeping it fresh. Returns
        (ok, seconds until this pod's next refresh). Each read and claim is a Redis round trip, paid by every
        replica for every pod at the pods' cadence: the replica holding the lease renews it without reading, and
        a reader looks for the next record a quarter of a cadence after it is due (the scrape behind it takes a
        while, longer on a busy pod or replica), and again a quarter later if it is not there yet."""
        address = endpoint.address
        now = asyncio.get_running_loop().time()
        if self._leased.get(address, -math.inf) <= now:
            record = await shared.read(address)
            wall = shared.wall_clock()
            if record is not None and record.replica != shared.replica_id and record.fresh(wall):
                self._set_rate(address, None)  # another replica scrapes it: not ours to count against max_rate
                ok = True
                settle = max(0.01, record.interval / 4)
                next_due = record.at + record.interval + settle - wall
                if self._applied.get(address) != record.at:  # each record counts once, for health too
                    self._applied[address] = record.at
                    ok = await self._apply(endpoint, record.metrics, record.at - wall)
                else:  # the next one is late: not every 10 ms until it comes
                    next_due = max(next_due, settle)
                endpoint.scrape_interval = record.interval
                return ok, max(0.01, next_due)
        hold = max(endpoint.scrape_interval, self.cadence.fast)
        if not await shared.claim(address, hold + grace(hold)):
            self._leased.pop(address, None)
            return True, min(0.02, self.cadence.fast)  # another replica took it just now: read its record soon
        # the lease lasts hold + grace from the claim: the next refresh (a cadence on, +-5 %) renews it in time
        self._leased[address] = now + hold + grace(hold) / 2
        ok = await self.scrape(endpoint)
        interval = self._paced(endpoint, ok)
        await shared.publish(address, endpoint.metrics if ok else None, interval)
        return ok, interval

    async def _apply(self, endpoint: Endpoint, metrics: EndpointMetrics | None, age_offset: float) -> bool:
        """Take another replica's scrape as ours (`age_offset`: its time minus now, <= 0)."""
        if metrics is None:
            await self._failed(endpoint, RuntimeError("the scraping replica's poll failed"))
            return False
        metrics.updated_at = self.clock() + min(0.0, age_offset)
        self._succeeded(endpoint, metrics)
        return True

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
        self.polls += 1
        try:
            metrics = parse_metrics(await self._page(endpoint), updated_at=self.clock())
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            await self._failed(endpoint, exc)
            if self.on_scrape is not None:
                self.on_scrape(endpoint, False, isinstance(exc, ValueError))
            return False
        if self.on_scrape is not None:
            self.on_scrape(endpoint, True, False)
        self._succeeded(endpoint, metrics)
        return True

    async def _page(self, endpoint: Endpoint) -> str:
        """The pod's metrics page: only the series we read when the pod takes the filter, else the whole page. A
        pod that refuses the filtered URL (a 4xx: not served there) or answers it without vLLM's queue gauge
        (another engine, an exporter that ignores the filter) is read whole from then on; a 5xx, a timeout or a
        refused connection is the pod's failure, not the filter's, and the next scrape asks for the series again."""
        session = self._ensure_session()
        address = endpoint.address
        url = self._urls.get(address)
        filtered = self.target.only_read_series and address not in self._whole_page
        if url is None:  # parsed once per pod: building the URL anew was ~10 % of a scrape's CPU
            text = self.target.filtered_url(endpoint) if filtered else None
            url = self._urls[address] = URL(text or self.target.url(endpoint), encoded=True)
        if filtered:
            try:
                page = await self._get(session, url)
                if VLLM_FILTER_MARK in page:
                    return page
                why = f"its answer has no {VLLM_FILTER_MARK}"
            except aiohttp.ClientResponseError as exc:
                if not 400 <= exc.status < 500:
                    raise
                why = f"HTTP {exc.status}"
            log.info("pod %s does not take the series filter at %s (%s): reading its whole metrics page", address,
                     url.path, why)
            self._whole_page.add(address)
            url = self._urls[address] = URL(self.target.url(endpoint), encoded=True)
        return await self._get(session, url)

    async def _get(self, session: aiohttp.ClientSession, url: URL) -> str:
        async with session.get(url, timeout=self.timeout) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            body = await resp.read()
        return body.decode("utf-8", "replace")

    def _succeeded(self, endpoint: Endpoint, metrics: EndpointMetrics) -> None:
        restart = started_over(endpoint.metrics, metrics)
        endpoint.metrics = metrics
        if self.health is not None:
            self.health.metrics_read(endpoint)
        if restart and self.health is not None:
            self.health.mark_restarted(endpoint, restart)
        endpoint.consecutive_failures = 0
        if self.health is not None and endpoint.state is not EndpointState.READY:
            self.health.mark_ready(endpoint, "metrics read again")
        if self.on_metrics is not None:
            self.on_metrics(endpoint)

    async def _failed(self, endpoint: Endpoint, exc: BaseException) -> None:
        self.failures += 1
        endpoint.consecutive_failures += 1
        if self.health is None or endpoint.consecutive_failures < self.failure_threshold:
            return
        cause = f"{endpoint.consecutive_failures} failed polls of {self.target.url(endpoint)} ({_describe(exc)})"
        if await self.reachable(endpoint):
            if endpoint.state is not EndpointState.DEGRADED:
                age = endpoint.metrics_age(self.clock())
                last = "never read" if age == float("inf") else f"last read {age:.1f} s ago"
                self.health.mark_degraded(endpoint, f"{cause}; its serving port answers, so it is routed on the "
                                                    f"picker's own counts and its metrics ({last})")
        elif endpoint.state is not EndpointState.UNREADY:
            self.health.mark_unready(endpoint, f"{cause}; its serving port {endpoint.address} refuses connections")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__
