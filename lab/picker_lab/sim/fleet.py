"""Start N simulated vLLM pods in one process: an async context manager and a thread-backed sync wrapper.

Async (tests and tools that already run an event loop)::

    async with SimFleet(4, host="127.0.0.1", base_port=0, profile="tiny-cpu", time_scale=10.0) as fleet:
        fleet.urls            # ["http://127.0.0.1:PORT", ...]
        fleet.pods[0].engine  # the Engine behind pod 0 (inspect its cache, counters, queues)

Sync (code without an event loop, e.g. a benchmark driving Envoy with blocking clients)::

    with SimFleetThread(4, profile="tiny-cpu") as fleet:   # runs the pods' loop in a daemon thread
        fleet.urls
        fleet.call(lambda: fleet.pods[0].engine.num_running)  # read engine state on the loop's thread

`base_port=0` picks free ports; otherwise pod i listens on base_port + i. With `kv_events_endpoint`
("tcp://127.0.0.1:Q") every pod publishes KV events to that one endpoint, under the topic `kv@<host>:<port>@<model>`
(the picker's `--kv-events-endpoint` binds it); with `kv_events_endpoint_base` pod i publishes to port Q + i under
the topic "kv-events". `kv_events_replay_port_base` R: pod i serves replays (vLLM's replay socket) on port R + i.
`kv_events_bind_port` P instead: each pod binds its publisher on tcp://<host>:P, as vLLM's tcp://*:P on a pod (the
picker's `--kv-events-port` connects to it; one pod per host address). `engine` ("vllm", "sglang", "trtllm") is whose metric
pages the pods serve.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from picker_lab.sim.data_parallel import DataParallelPod
from picker_lab.sim.dialects import MetricDialect
from picker_lab.sim.kv_events import DEFAULT_TOPIC
from picker_lab.sim.profiles import Profile, get_profile
from picker_lab.sim.server import PodConfig, SimPod

T = TypeVar("T")


def kv_endpoint_for(base: str | None, index: int) -> str | None:
    """tcp://host:Q -> tcp://host:(Q + index); None stays None."""
    if not base:
        return None
    head, _, port = base.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"KV-events endpoint needs a port: {base!r}")
    return f"{head}:{int(port) + index}"


class SimFleet:
    """N independent simulated pods sharing this process's event loop."""

    def __init__(
        self,
        n: int,
        *,
        host: str = "127.0.0.1",
        base_port: int = 0,
        profile: str | Profile = "tiny-cpu",
        time_scale: float = 1.0,
        model: str | None = None,
        lora_modules: dict[str, str] | None = None,
        seed: int = 0,
        kv_events_endpoint_base: str | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_replay_port_base: int = 0,
        kv_events_bind_port: int = 0,
        name_prefix: str = "sim",
        first_index: int = 0,
        process_metrics: bool = True,
        profile_overrides: dict[str, object] | None = None,
        engine: MetricDialect = "vllm",
        data_parallel_size: int = 1,
    ) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one pod")
        prof = get_profile(profile) if isinstance(profile, str) else profile
        if profile_overrides:
            prof = prof.with_overrides(**profile_overrides)
        self.profile = prof
        configs = [
            PodConfig(
                name=f"{name_prefix}-{first_index + i}",
                profile=prof,
                model=model,
                host=host,
                port=base_port + i if base_port else 0,
                time_scale=time_scale,
                seed=seed,
                lora_modules=dict(lora_modules or {}),
                kv_events_endpoint=kv_events_endpoint or kv_endpoint_for(kv_events_endpoint_base, i),
                kv_events_topic=None if kv_events_endpoint else DEFAULT_TOPIC,
                kv_events_replay=(f"tcp://{host}:{kv_events_replay_port_base + i}"
                                  if kv_events_replay_port_base else None),
                kv_events_bind_port=kv_events_bind_port,
                process_metrics=process_metrics,
                engine=engine,
            )
            for i in range(n)
        ]
        # data-parallel servers: each pod N engines behind its port (picker_lab.sim.data_parallel)
        self.pods: list[SimPod] = [DataParallelPod(c, data_parallel_size) if data_parallel_size > 1 else SimPod(c)
                                   for c in configs]

    @property
    def urls(self) -> list[str]:
        """Base URLs of the pods, in pod order."""
        return [p.url for p in self.pods]

    @property
    def ports(self) -> list[int]:
        """Listening ports, in pod order."""
        return [p.port for p in self.pods]

    async def start(self) -> None:
        """Start every pod; on failure the ones already started are stopped."""
        try:
            for pod in self.pods:
                await pod.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every pod (safe to call twice)."""
        for pod in self.pods:
            await pod.stop()

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class SimFleetThread:
    """A SimFleet on its own event loop in a daemon thread, for synchronous callers."""

    def __init__(self, n: int, **kwargs: object) -> None:
        self._n = n
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-fleet", daemon=True)
        self.fleet: SimFleet | None = None

    def start(self) -> SimFleetThread:
        """Start the thread and the pods; returns when every pod listens."""
        self._thread.start()

        async def make() -> SimFleet:
            fleet = SimFleet(self._n, **self._kwargs)  # type: ignore[arg-type]
            await fleet.start()
            return fleet

        self.fleet = asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout=60)
        return self

    def stop(self) -> None:
        """Stop the pods and the thread."""
        if self.fleet is not None:
            asyncio.run_coroutine_threadsafe(self.fleet.stop(), self._loop).result(timeout=60)
            self.fleet = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the fleet's loop thread (engine state is not thread-safe) and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=60)

    @property
    def pods(self) -> list[SimPod]:
        """The pods (read their engines through `call`)."""
        assert self.fleet is not None, "fleet not started"
        return self.fleet.pods

    @property
    def urls(self) -> list[str]:
        """Base URLs of the pods."""
        assert self.fleet is not None, "fleet not started"
        return self.fleet.urls

    def __enter__(self) -> SimFleetThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
