"""KV events relayed between replicas through a real Valkey (bind mode, `--index-backend redis`): what one
replica's socket receives reaches the others' views in order; a replica never reads back its own; only
messages for a pod of the pool are relayed."""

from __future__ import annotations

import asyncio
import uuid

from picker.kvevents.relay import EventRelay
from picker.prefix.precise import PreciseIndex, token_keys
from picker_lab.supervisor import Valkey
from tests.test_kv_events import message, stored, subscriber
from tests.waiting import eventually_async

POD = "10.0.0.1:8000"


async def test_what_one_replica_hears_reaches_the_others_view(valkey: Valkey) -> None:
    namespace = f"relay-{uuid.uuid4().hex[:8]}"
    views = [PreciseIndex(), PreciseIndex()]
    subs = [subscriber(view, replay=None) for view in views]
    relays = [EventRelay(valkey.url, namespace, sub.receive_relayed) for sub in subs]
    for sub, relay in zip(subs, relays, strict=True):
        sub.relay = relay.relay
        relay.start()
    try:
        await asyncio.gather(*(asyncio.wait_for(r.following.wait(), 5) for r in relays))
        tokens = list(range(12))
        keys = token_keys(tokens, 4)
        await subs[0].receive(message(0, stored(tokens[:4], 4, [1])))
        await subs[0].receive(message(1, stored(tokens[4:8], 4, [2], parent=1)))
        await subs[0].receive(message(1, stored(tokens[4:8], 4, [2], parent=1)))  # a duplicate: relayed, dropped
        await subs[0].receive([b"not", b"an event"])  # malformed: not relayed
        await subs[0].receive(message(2, stored(tokens[8:], 4, [3], parent=2)))

        async def mirrored() -> bool:
            return views[1].pod(POD).matched(keys, 100.0) == 3
        await eventually_async(mirrored, "replica B's view holds what A heard", within=5)
        assert views[0].pod(POD).matched(keys, 100.0) == 3
        assert subs[1].stats.batches == 3 and subs[1].stats.duplicates == 1 and subs[1].stats.malformed == 0
        assert relays[0].stats.sent == 4 and relays[1].stats.received == 4  # the malformed one stayed home
        assert relays[0].stats.received == 0 and relays[1].stats.sent == 0  # nobody reads back its own
    finally:
        for relay in relays:
            await relay.stop()


async def test_without_redis_each_replica_keeps_its_own_pods() -> None:
    """Valkey unreachable: the replica applies what it hears, its relay counts errors and retries, nothing hangs."""
    view = PreciseIndex()
    sub = subscriber(view, replay=None)
    relay = EventRelay("redis://127.0.0.1:1/0", "nowhere", sub.receive_relayed)
    sub.relay = relay.relay
    relay.start()
    try:
        await sub.receive(message(0, stored(list(range(4)), 4, [1])))
        assert view.pod(POD).matched(token_keys(list(range(4)), 4), 100.0) == 1

        async def failing() -> bool:
            return relay.stats.errors >= 2
        await eventually_async(failing, "the relay retrying", within=5)
        assert relay.stats.sent == 0
    finally:
        await asyncio.wait_for(relay.stop(), 5)
