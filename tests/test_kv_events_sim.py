"""The precise view follows real KV-event streams: `picker sim` pods publish over ZMQ to the one endpoint the
subscriber binds, each pod under its own topic. The view must hold exactly the blocks each pod's cache holds,
through evictions and a cache reset; a subscriber that starts while the pods run (a restarted picker) rebuilds it
from the pods' replay sockets; one that cannot replay resets the view and distrusts it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from picker.kvevents.events import EventBatch
from picker.kvevents.subscriber import KVEventSubscriber, ZmqReplayer
from picker.prefix.precise import PreciseIndex, token_keys
from picker_lab.sim.data_parallel import DataParallelPod
from picker_lab.sim.fleet import SimFleet
from picker_lab.sim.kvcache import block_hashes
from picker_lab.supervisor import free_port, free_port_range
from tests.waiting import eventually

BLOCK = 16
PODS = 2


class PortPerPod:
    """The sim's pods share one host, so each serves replays on its own port (base + its index); in a cluster
    every pod serves them on the same port of its own IP, which is ZmqReplayer as it is."""

    def __init__(self, base: int, addresses: list[str]) -> None:
        self.replayers = {a: ZmqReplayer(base + i) for i, a in enumerate(addresses)}

    async def fetch(self, host: str, start: int, stop: int, dp_rank: int = 0) -> list[EventBatch] | None:
        return await self.replayers[host].fetch(host, start, stop, dp_rank)


@dataclass
class Following:
    fleet: SimFleet
    endpoint: str
    addresses: list[str]
    replay_base: int
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def subscribe(self, replay: bool = True) -> tuple[PreciseIndex, KVEventSubscriber]:
        """A subscriber on the pods' endpoint, with a view of its own."""
        index = PreciseIndex()
        wanted = set(self.addresses)
        subscriber = KVEventSubscriber(self.endpoint, index, lambda host: host if host in wanted else None,
                                       replayer=PortPerPod(self.replay_base, self.addresses) if replay else None)
        task = asyncio.create_task(subscriber.run())
        self.tasks.append(task)
        await asyncio.wait_for(subscriber.bound.wait(), 5)
        return index, subscriber

    async def until_connected(self, subscriber: KVEventSubscriber) -> None:
        """Until every pod's publisher has (re)connected: a PUB socket drops what it sends before (ZMQ's slow
        joiner), which the subscriber sees as a gap in the next message and fills from the replay socket."""
        async with aiohttp.ClientSession() as http:
            for attempt in range(100):
                if all(subscriber.stats.by_pod.get(a) for a in self.addresses):
                    return
                for url in self.fleet.urls:
                    body = {"prompt": [7, attempt % 100 + 300] * BLOCK, "max_tokens": 1}
                    async with http.post(url + "/v1/completions", json=body) as response:
                        assert response.status == 200
                await asyncio.sleep(0.05)
        raise AssertionError("the pods' publishers never reached the subscriber")

    async def unsubscribe(self) -> None:
        """Stop every subscriber (the picker goes away); the pods keep publishing."""
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.tasks.clear()

    def mirrored(self, index: PreciseIndex) -> bool:
        return all(set(index.pod(a).keys) == set(pod.engine.kv.cached) for a, pod in zip(self.addresses,
                                                                                          self.fleet.pods,
                                                                                          strict=True))


@pytest.fixture
async def following() -> AsyncIterator[Following]:
    endpoint, replay_base, base = f"tcp://127.0.0.1:{free_port()}", free_port_range(PODS), free_port_range(PODS)
    async with SimFleet(PODS, base_port=base, profile="tiny-cpu", time_scale=50.0, kv_events_endpoint=endpoint,
                        kv_events_replay_port_base=replay_base,
                        profile_overrides={"block_size": BLOCK, "num_gpu_blocks": 40}) as fleet:
        f = Following(fleet, endpoint, [u.removeprefix("http://") for u in fleet.urls], replay_base)
        try:
            yield f
        finally:
            await f.unsubscribe()


async def traffic(fleet: SimFleet, seed: int, n: int = 30) -> list[list[int]]:
    """Prompts with shared and own prefixes, sent straight to the pods in turn: enough to evict (40 blocks)."""
    rng = random.Random(seed)
    shared = [[rng.randrange(300, 4000) for _ in range(3 * BLOCK)] for _ in range(4)]
    prompts = []
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            prompt = rng.choice(shared) + [rng.randrange(300, 4000) for _ in range(rng.randrange(5, 60))]
            prompts.append(prompt)
            async with http.post(fleet.urls[i % PODS] + "/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 2}) as response:
                assert response.status == 200
    return prompts


async def test_the_view_holds_what_each_pod_caches_through_evictions_and_a_reset(following: Following) -> None:
    f = following
    index, subscriber = await f.subscribe()
    await f.until_connected(subscriber)
    prompts = await traffic(f.fleet, seed=1, n=60)  # 30 prompts a pod: more than its 40 blocks hold
    await eventually(lambda: f.mirrored(index), what="every pod's cache mirrored")
    assert sum(p.engine.kv.num_cached_blocks() for p in f.fleet.pods) > 0
    assert subscriber.stats.malformed == 0 and subscriber.stats.unknown_topic == 0
    for k, pod in enumerate(f.fleet.pods):  # blocks it computed and no longer holds: evictions were mirrored
        computed = {h for prompt in prompts[k::PODS] for h in block_hashes(prompt, BLOCK)}
        assert computed - set(pod.engine.kv.cached), f"pod {k} evicted nothing: the test shows no eviction"
    pod, address = f.fleet.pods[0], f.addresses[0]
    prompt = prompts[-2]  # the last one pod 0 served: the view answers what it would hit
    hits = len(pod.engine.kv.lookup(block_hashes(prompt, BLOCK), 1000))
    assert index.pod(address).matched(token_keys(prompt, BLOCK), 0.0) == hits > 0
    async with aiohttp.ClientSession() as http, http.post(pod.url + "/reset_prefix_cache") as response:
        assert response.status == 200
    await eventually(lambda: not index.pod(address).keys, what="AllBlocksCleared followed")
    assert f.mirrored(index) and index.fresh(address, 0.0)


async def test_a_restarted_subscriber_rebuilds_the_view_from_the_replay_sockets(following: Following) -> None:
    f = following
    first, subscriber = await f.subscribe()
    await f.until_connected(subscriber)
    await traffic(f.fleet, seed=2)
    await eventually(lambda: f.mirrored(first), what="mirrored before the restart")
    await f.unsubscribe()
    await traffic(f.fleet, seed=3, n=10)  # while no picker listens: lost to it
    index, subscriber = await f.subscribe()
    await f.until_connected(subscriber)  # each pod's first message shows the gap: replayed from the start
    await eventually(lambda: f.mirrored(index), what="rebuilt from the replays")
    assert subscriber.stats.replayed > 0 and subscriber.stats.resets == 0
    assert all(index.fresh(a, 0.0) for a in f.addresses)


async def test_without_replay_a_gap_resets_the_view_and_distrusts_it(following: Following) -> None:
    f = following
    await traffic(f.fleet, seed=5, n=10)  # before anyone listens
    index, subscriber = await f.subscribe(replay=False)
    await f.until_connected(subscriber)
    await eventually(lambda: subscriber.stats.resets == PODS, what="both pods' views reset")
    assert not any(index.fresh(a, 0.0) for a in f.addresses)  # scored from the approximate index meanwhile


async def test_each_rank_of_a_data_parallel_server_is_followed_on_its_own_port_into_its_own_view() -> None:
    # connect mode: the server's engines bind the publisher port + their rank (vLLM's rule), replays likewise
    port, replay = free_port_range(2), free_port_range(2)
    async with SimFleet(1, base_port=free_port(), profile="tiny-cpu", time_scale=50.0, kv_events_bind_port=port,
                        kv_events_replay_port_base=replay, data_parallel_size=2,
                        profile_overrides={"block_size": BLOCK, "num_gpu_blocks": 40}) as fleet:
        address, server = fleet.urls[0].removeprefix("http://"), fleet.pods[0]
        assert isinstance(server, DataParallelPod)
        index = PreciseIndex()
        subscriber = KVEventSubscriber("", index, lambda host: None, target_of=lambda a, rank: f"{a}#{rank}",
                                       replayer=ZmqReplayer(replay))
        subscriber.follow(address, "127.0.0.1", port)
        subscriber.follow(address, "127.0.0.1", port, ranks=2)  # its second rank learned later: that port too
        rng = random.Random(9)
        shared = [rng.randrange(300, 4000) for _ in range(3 * BLOCK)]
        try:
            async with aiohttp.ClientSession() as http:
                for i in range(24):
                    prompt = shared[: (i % 3 + 1) * BLOCK] + [rng.randrange(300, 4000) for _ in range(BLOCK)]
                    async with http.post(fleet.urls[0] + "/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                                         headers={"X-data-parallel-rank": str(i % 2)}) as response:
                        assert response.status == 200
            await eventually(lambda: all(set(index.pod(f"{address}#{r}").keys) == set(engine.engine.kv.cached)
                                         for r, engine in enumerate(server.ranks)), what="each rank mirrored")
            assert all(engine.engine.kv.num_cached_blocks() for engine in server.ranks)
            assert set(subscriber.stats.by_pod) == {f"{address}#0", f"{address}#1"}
            assert subscriber.stats.resets == 0 and subscriber.stats.malformed == 0
        finally:
            await subscriber.stop()
