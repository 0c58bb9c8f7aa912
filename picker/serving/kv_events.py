"""The pods' KV events into the precise view: one subscriber, in bind mode (the pods connect to the picker) or
connect mode (the picker connects to each pod), kept in step with the pool: servers joining and leaving, a
restarted server's view dropped, each data-parallel rank's events feeding its own target's view (its ports bound
or followed as the pool learns of its ranks). Bind-mode replicas relay what each heard through Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.state import Endpoint
from picker.kvevents.relay import EventRelay
from picker.prefix.precise import PreciseIndex
from picker.serving.config import ServeConfig
from picker.serving.metrics import PickerMetrics
from picker.serving.policy import index_namespace


def start_kv_events(c: ServeConfig, pool: EndpointPool, index: PreciseIndex, metrics: PickerMetrics,
                    supervise: Callable[[asyncio.Task[None]], None],
                    on_stop: Callable[[str, Callable[[], Awaitable[object]]], None]) -> None:
    """Follow the pods' KV events into the precise view (`supervise` runs the listener, `on_stop` closes what was
    opened); a pod that leaves is forgotten there too."""
    from picker.kvevents.subscriber import KVEventSubscriber, ZmqReplayer  # pyzmq: the kv-events extra

    hosts: dict[str, str] = {}  # what a topic may name a pod by (ip:port, or its ip) -> its address

    def learn_hosts() -> None:
        hosts.clear()
        for e in pool.all():
            hosts[e.address] = e.address
            hosts.setdefault(e.ip, e.address)

    def target_of(address: str, dp_rank: int) -> str:
        """A ranked server's rank `dp_rank` feeds its rank's view; a server routed as one, its own."""
        server = pool.get(address)
        ranks = pool.ranks(server) if server is not None else ()
        return next((r.address for r in ranks if r.rank == dp_rank), address)

    replayer = ZmqReplayer(c.kv_events_replay_port) if c.kv_events_replay_port else None
    events = KVEventSubscriber(c.kv_events_endpoint, index, hosts.get, target_of=target_of, replayer=replayer)
    on_stop("kv-event subscriber", events.stop)

    def pool_changed(event: PoolEvent, endpoint: Endpoint) -> None:
        learn_hosts()
        server = endpoint.server or endpoint
        if event is PoolEvent.REMOVED or event is PoolEvent.RESTARTED:
            index.forget(endpoint.address)  # a restarted pod's events start over from 0 too
        if pool.get(server.address) is not server:  # the server left the pool
            events.unfollow(server.address)
            return
        ranks = len(pool.ranks(server)) or 1
        if event is PoolEvent.ADDED or event is PoolEvent.REMOVED:  # its targets changed: views start over
            events.restart_streams(server.address)
        if c.kv_events_port:
            events.follow(server.address, server.ip, c.kv_events_port, ranks)
        else:
            events.listen_ranks(ranks)

    learn_hosts()
    pool.subscribe(pool_changed)
    metrics.watch_kv_events(events.stats, index, events.clock)
    if c.kv_events_port:  # connect mode: one reader per pod of the pool
        for endpoint in pool.all():
            events.follow(endpoint.address, endpoint.ip, c.kv_events_port, len(pool.ranks(endpoint)) or 1)
        return
    events.listen_ranks(max((len(pool.ranks(e)) for e in pool.all()), default=1))
    supervise(asyncio.create_task(events.run(), name="kv-events"))
    if c.index_backend == "redis":  # bind mode with replicas: each hears some pods, the relay gives it all
        relay = EventRelay(c.redis_url, index_namespace(c), events.receive_relayed)
        on_stop("kv-event relay", relay.stop)
        events.relay = relay.relay
        metrics.watch_kv_relay(relay.stats)
        relay.start()
