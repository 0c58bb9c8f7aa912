"""A simulated vLLM server with several data-parallel ranks behind one port (vLLM's `--data-parallel-size N`).

As vLLM 0.32 runs it: one API server, N engines, each with its own KV cache. A request naming a rank in
`X-data-parallel-rank` goes to that engine (an integer out of range is a 400, anything else not an integer is
ignored, as vLLM's `_get_data_parallel_rank` reads it); any other is balanced by vLLM's own rule
(`DPLBAsyncMPClient.get_core_engine_for_request`): the engine with the lowest max(in flight, waiting + running),
plus 6 x waiting x the KV use above 50 %, the scan's start rotating so ties spread. `/metrics` is one page with
every engine's series labelled `engine="0"`, `engine="1"`... With KV events, each engine publishes its own
under the server's topic, rank r on the configured endpoint's port + r with r in the payload (vLLM's rule).

Rank 0 is the server itself (a `SimPod`: its port, its name); the other ranks are pods without a port whose
handlers it calls. Every response says which rank served it (`x-sim-rank`), and `GET /sim/ranks` gives each
rank's counters: requests, those steered by the header, prefix-cache queries and hits (tokens), queue."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from picker_lab.sim.dialects import PROMETHEUS_TEXT, MetricsPage
from picker_lab.sim.metrics import SimMetrics, exposition_text
from picker_lab.sim.openai_api import ApiError
from picker_lab.sim.server import PodConfig, SimPod

RANK_HEADER = "X-data-parallel-rank"  # as vLLM spells it (HTTP headers are case-insensitive)
SERVED_RANK_HEADER = "x-sim-rank"
_RANK_KEY = web.RequestKey("sim_rank", int)


class DataParallelPod(SimPod):
    """`ranks` engines behind one port; rank 0 is this pod. Only vLLM's metric dialect."""

    def __init__(self, config: PodConfig, ranks: int) -> None:
        if ranks < 2:
            raise ValueError("a data-parallel server has two ranks or more")
        if config.engine != "vllm":
            raise ValueError("a data-parallel server speaks vLLM's metrics")
        super().__init__(dataclasses.replace(config, rank=0))
        self.ranks: list[SimPod] = [self, *(SimPod(dataclasses.replace(config, rank=r, port=0, seed=config.seed + r,
                                                                        process_metrics=False))
                                            for r in range(1, ranks))]
        self.requests = [0] * ranks  # generation requests each rank was given
        self.steered = [0] * ranks  # of which named it in the header
        self._in_flight = [0] * ranks
        self._start_index = 0

    async def start(self) -> None:
        await super().start()
        topic = self.publisher.topic if self.publisher is not None else None
        for rank in self.ranks[1:]:
            rank.start_engine()
            rank.open_publisher(topic)  # the server's topic: vLLM's engines share it

    async def stop(self) -> None:
        for rank in self.ranks[1:]:
            await rank.stop()
        await super().stop()

    def make_app(self) -> web.Application:
        app = super().make_app()
        app.router.add_get("/sim/ranks", self.rank_counters)
        return app

    # --- which engine ----------------------------------------------------------------------------------------
    def choose(self, header: str | None) -> tuple[int, bool]:
        """(rank, steered by the header) for a request carrying `header` (None: none)."""
        if header is not None:
            try:
                rank = int(header)
            except ValueError:
                rank = -1  # vLLM ignores a value that is no integer
            else:
                if not 0 <= rank < len(self.ranks):
                    raise ApiError(f"data_parallel_rank {rank} is out of range [0, {len(self.ranks)}).", 400)
                return rank, True
        best, best_score = 0, float("inf")
        n = len(self.ranks)
        for i in range(n):
            idx = (self._start_index + i) % n
            engine = self.ranks[idx].engine
            waiting = engine.num_waiting
            score = max(float(self._in_flight[idx]), float(waiting + engine.num_running))
            if waiting:
                score += waiting * 6.0 * max(0.0, engine.kv_usage() - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self._start_index = (self._start_index + 1) % n
        return best, False

    async def _on_rank(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rank, steered = self.choose(request.headers.get(RANK_HEADER))
        self.requests[rank] += 1
        self.steered[rank] += steered
        request[_RANK_KEY] = rank
        pod = self.ranks[rank]
        self._in_flight[rank] += 1
        try:
            if pod is self:
                return await (SimPod.chat_completions(self, request) if chat else SimPod.completions(self, request))
            return await (pod.chat_completions(request) if chat else pod.completions(request))
        finally:
            self._in_flight[rank] -= 1

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._on_rank(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._on_rank(request, chat=True)

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        await super()._tag_response(request, response)
        rank = request.get(_RANK_KEY)
        if rank is not None:
            response.headers[SERVED_RANK_HEADER] = str(rank)

    async def rank_counters(self, request: web.Request) -> web.Response:
        """GET /sim/ranks: what each rank was given and what its cache served."""
        return self._json({"ranks": [
            {"rank": r, "requests": self.requests[r], "steered": self.steered[r],
             "prefix_cache_queries": pod.engine.stats.prefix_cache_queries,
             "prefix_cache_hits": pod.engine.stats.prefix_cache_hits,
             "running": pod.engine.num_running, "waiting": pod.engine.num_waiting}
            for r, pod in enumerate(self.ranks)]})

    # --- one page for every engine ---------------------------------------------------------------------------
    def metric_pages(self) -> list[MetricsPage]:
        return [MetricsPage("/metrics", PROMETHEUS_TEXT, self.render_metrics, takes_names=True)]

    def render_metrics(self) -> bytes:
        """vLLM's page of a data-parallel server: each family once, with every engine's samples in it."""
        return generate_latest(self.metrics.process_registry) + exposition_text(
            _merged([pod.metrics for pod in self.ranks])).encode()


def _merged(engines: list[SimMetrics]) -> Iterator[Metric]:
    """The engines' families side by side (every engine of a server yields the same families in the same order)."""
    for families in zip(*(m.collect() for m in engines), strict=True):
        first = families[0]
        merged = Metric(first.name, first.documentation, first.type)
        for family in families:
            merged.samples.extend(family.samples)
        yield merged
