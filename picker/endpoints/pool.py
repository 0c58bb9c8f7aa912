"""The set of endpoints the picker may route to. The pool owns every change of it: discovery adds and removes
endpoints, health checks mark them unready, degraded and ready again, and each change is one event to the
listeners (the scheduler purges a departed or unready pod's prefix-index entries, metrics drop a departed pod's
series) and one log line, so no state outlives a pod and no consumer hears of a change by a different path than
another.

A degraded pod is one whose metrics cannot be read while its serving port answers (a wrong metrics port, a
NetworkPolicy, a metrics endpoint too slow under load): it stays routable on what the picker knows itself (its
in-flight counts, the prefix index, its last metrics, stale), because a load signal we cannot read must not turn
into an outage. Only a pod that cannot be reached leaves the ready set.

A server with several data-parallel ranks behind one port (vLLM's `--data-parallel-size`, its page labelling each
engine's series `engine="0"`, `engine="1"`...) is routed as one target per rank: each an Endpoint of its own
("ip:port#rank") with its own in-flight counts, metrics (its engine's series) and prefix-index entries. The server
stays what discovery listed, the scraper reads and health follows; the pool turns it into its ranks, from its
page or a configured count, and tells the listeners of targets that come and go like any pod's."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable

from picker.endpoints.load_column import LoadColumn
from picker.endpoints.state import RANK_MARK, Endpoint, EndpointMetrics, EndpointState

log = logging.getLogger(__name__)


class PoolEvent(enum.Enum):
    ADDED = "added"  # discovery found it (it starts ready)
    REMOVED = "removed"  # discovery lost it: forget everything about it
    UNREADY = "unready"  # it cannot be reached: not routed to until it recovers
    DEGRADED = "degraded"  # its metrics cannot be read but it answers: routed on our own view of it
    READY = "ready"  # it recovered
    RESTARTED = "restarted"  # its counters started over: it restarted between two scrapes, its cache is empty


PoolListener = Callable[[PoolEvent, Endpoint], None]


class EndpointPool:
    """Endpoints by address, with the ready ones precomputed (read on every request). `ranks`: every server's
    data-parallel ranks when the operator says how many (0: as each server's metrics label them)."""

    def __init__(self, ranks: int = 0) -> None:
        if ranks < 0:
            raise ValueError("ranks must be >= 0")
        self.configured_ranks = ranks
        self._endpoints: dict[str, Endpoint] = {}  # the servers, as discovery lists them
        self._ranks: dict[str, tuple[Endpoint, ...]] = {}  # server address -> its ranks (two or more)
        self._by_rank: dict[str, Endpoint] = {}  # rank identity -> rank
        self._ready: list[Endpoint] = []
        self._loads = LoadColumn()  # the ready pods' in-flight counts and pick times in numpy (large pools' sampling)
        self._listeners: list[PoolListener] = []

    def subscribe(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: PoolEvent, endpoint: Endpoint) -> None:
        for listener in self._listeners:
            listener(event, endpoint)

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]]:
        """Replace the pool with `endpoints` (keeping state of those already known); returns (added, removed)."""
        wanted = {e.address: e for e in endpoints}
        removed = [e for addr, e in self._endpoints.items() if addr not in wanted]
        added: list[Endpoint] = []
        merged: dict[str, Endpoint] = {}
        for addr, endpoint in wanted.items():
            known = self._endpoints.get(addr)
            if known is None:
                added.append(endpoint)
                merged[addr] = endpoint
            else:
                known.name = endpoint.name or known.name
                known.labels = endpoint.labels
                for rank in self._ranks.get(addr, ()):
                    rank.name, rank.labels = f"{known.name}{RANK_MARK}{rank.rank}", known.labels
                merged[addr] = known
        self._endpoints = merged
        gone = [rank for e in removed for rank in self._ranks.pop(e.address, ())]
        for rank in gone:
            del self._by_rank[rank.address]
        for endpoint in added:
            if self.configured_ranks > 1:
                self._make_ranks(endpoint, range(self.configured_ranks))
        self._refresh()
        for endpoint in (*gone, *removed):  # a server with ranks: its ranks, then the server itself
            self._emit(PoolEvent.REMOVED, endpoint)
        for endpoint in added:
            for target in self._ranks.get(endpoint.address, (endpoint,)):
                self._emit(PoolEvent.ADDED, target)
        return added, removed

    def metrics_read(self, server: Endpoint) -> None:
        """`server`'s metrics were just read: its ranks are those its page labels (or the configured count),
        each given its own engine's series. A server whose rank count changed (restarted with another
        data-parallel size) loses the ranks it no longer has and gains the new ones, as pool events."""
        if self._endpoints.get(server.address) is not server:
            return
        engines = server.metrics.engines
        if self.configured_ranks:
            wanted: tuple[int, ...] = tuple(range(self.configured_ranks)) if self.configured_ranks > 1 else ()
        else:
            wanted = tuple(sorted(engines)) if engines else ()
        ranks = self._ranks.get(server.address, ())
        if tuple(r.rank for r in ranks) != wanted:
            ranks = self._rerank(server, ranks, wanted)
        for rank in ranks:
            rank.metrics = rank_metrics(server.metrics, rank.rank, len(ranks))

    def _make_ranks(self, server: Endpoint, numbers: Iterable[int]) -> None:
        ranks = tuple(Endpoint.rank_of(server, n) for n in numbers)
        self._ranks[server.address] = ranks
        self._by_rank.update((r.address, r) for r in ranks)

    def _rerank(self, server: Endpoint, old: tuple[Endpoint, ...], numbers: tuple[int, ...]) -> tuple[Endpoint, ...]:
        """`server`'s ranks become `numbers` (none: routed as one again); the targets that go and come are told."""
        kept = {r.rank: r for r in old if r.rank in numbers}
        for rank in old:
            self._by_rank.pop(rank.address, None)
        self._ranks.pop(server.address, None)
        ranks = (tuple(kept.get(n) or Endpoint.rank_of(server, n) for n in numbers) if numbers else ())
        if ranks:
            self._ranks[server.address] = ranks
            self._by_rank.update((r.address, r) for r in ranks)
        gone = [r for r in old if r.rank not in kept] if old else [server]
        came = [r for r in ranks if r.rank not in kept] if ranks else [server]
        self._refresh()
        log.info("endpoint %s serves %s", server.address,
                 f"{len(ranks)} data-parallel ranks ({', '.join(str(r.rank) for r in ranks)})" if ranks
                 else "as one rank")
        for endpoint in gone:
            self._emit(PoolEvent.REMOVED, endpoint)
        for endpoint in came:
            self._emit(PoolEvent.ADDED, endpoint)
        return ranks

    def mark_unready(self, endpoint: Endpoint, reason: str = "") -> None:
        """Stop routing to `endpoint` (it cannot be reached); no-op when it already is unready or gone."""
        self._transition(endpoint, EndpointState.UNREADY, PoolEvent.UNREADY, reason)

    def mark_degraded(self, endpoint: Endpoint, reason: str = "") -> None:
        """Keep routing to `endpoint` on stale metrics (they cannot be read, the pod answers)."""
        self._transition(endpoint, EndpointState.DEGRADED, PoolEvent.DEGRADED, reason)

    def mark_ready(self, endpoint: Endpoint, reason: str = "") -> None:
        """Route to `endpoint` on fresh metrics again."""
        self._transition(endpoint, EndpointState.READY, PoolEvent.READY, reason)

    def mark_restarted(self, endpoint: Endpoint, reason: str = "") -> None:
        """`endpoint` restarted unseen (between two scrapes: never unready): whatever was known of its cache is gone,
        its state stays."""
        if self._endpoints.get(endpoint.address) is not endpoint:
            return
        log.warning("endpoint %s restarted%s: what it cached is forgotten", endpoint.address,
                    f" ({reason})" if reason else "")
        for target in self._ranks.get(endpoint.address, (endpoint,)):
            self._emit(PoolEvent.RESTARTED, target)

    def _transition(self, endpoint: Endpoint, state: EndpointState, event: PoolEvent, reason: str) -> None:
        if endpoint.state is state or self._endpoints.get(endpoint.address) is not endpoint:
            return
        was = endpoint.state
        endpoint.state = state
        ranks = self._ranks.get(endpoint.address, ())
        for rank in ranks:  # a rank is as reachable as its server
            rank.state = state
        self._refresh()
        log.log(logging.INFO if state is EndpointState.READY else logging.WARNING, "endpoint %s %s -> %s%s",
                endpoint.address, was.value, state.value, f": {reason}" if reason else "")
        for target in ranks or (endpoint,):
            self._emit(event, target)

    def _refresh(self) -> None:
        self._ready = [t for e in self._endpoints.values() if e.healthy for t in self._ranks.get(e.address, (e,))]
        self._loads.track(self._ready)

    def get(self, address: str) -> Endpoint | None:
        """A server or a rank, by its identity."""
        return self._endpoints.get(address) or self._by_rank.get(address)

    def all(self) -> list[Endpoint]:
        """The servers, as discovery listed them (what is scraped)."""
        return list(self._endpoints.values())

    def targets(self) -> list[Endpoint]:
        """What requests are routed to, healthy or not: every server, or its ranks when it has several."""
        return [t for e in self._endpoints.values() for t in self._ranks.get(e.address, (e,))]

    def ranks(self, server: Endpoint) -> tuple[Endpoint, ...]:
        """`server`'s data-parallel ranks (none: it is routed as one)."""
        return self._ranks.get(server.address, ())

    def ready(self) -> list[Endpoint]:
        """Routable endpoints (ready or degraded); the returned list is shared, callers must not mutate it."""
        return self._ready

    def __len__(self) -> int:
        return len(self._endpoints)


def rank_metrics(server: EndpointMetrics, rank: int, ranks: int) -> EndpointMetrics:
    """What rank `rank` of `ranks` reports: its engine's own series, or, when the page does not label engines
    (a configured count), an even share of the server's queue, running requests and cache blocks, its KV use and
    the rest as the server's."""
    own = server.engines.get(rank) if server.engines else None
    if own is not None:
        return own
    share = 1.0 / ranks
    blocks = server.num_gpu_blocks // ranks if server.num_gpu_blocks else None
    return EndpointMetrics(
        waiting=server.waiting * share, running=server.running * share, kv_usage=server.kv_usage,
        block_size=server.block_size, num_gpu_blocks=blocks or None, max_lora=server.max_lora,
        running_loras=server.running_loras, waiting_loras=server.waiting_loras, models=server.models,
        updated_at=server.updated_at)
