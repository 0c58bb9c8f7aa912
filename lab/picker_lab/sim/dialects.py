"""The metric pages of the other engines a simulated pod can speak (`picker sim --engine sglang|trtllm`): SGLang's
and TensorRT-LLM's series, as their servers expose them, following the same simulated engine."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from prometheus_client.utils import floatToGoString

from picker_lab.sim.engine import Engine, StepResult

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

MetricDialect = Literal["vllm", "sglang", "trtllm"]
DIALECTS: tuple[MetricDialect, ...] = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class MetricsPage:
    """One GET route a pod serves metrics on: its path, content type and what renders its body."""

    path: str
    content_type: str
    render: Callable[[], bytes]
    # also served at `path/`, cut down to the samples a GET names (`?name[]=...`), as vLLM's exporter does
    takes_names: bool = False


class DialectPages(Protocol):
    """Another engine's metric pages for a simulated pod, and the engine events they follow."""

    def pages(self) -> list[MetricsPage]: ...

    def observe_step(self, result: StepResult) -> None: ...

    def observe_finished(self) -> None: ...


def dialect_pages(dialect: MetricDialect, engine: Engine, model_name: str) -> DialectPages | None:
    if dialect == "sglang":
        return SGLangPages(engine, model_name)
    if dialect == "trtllm":
        return TrtllmPages(engine, model_name)
    return None


def _gauge_text(name: str, doc: str, labels: str, value: float) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} gauge\n{name}{{{labels}}} {floatToGoString(value)}\n"


def _label_list(*pairs: tuple[str, str]) -> str:
    """`a="x",b="y"` in the order given (as the engine writes them), with Prometheus escapes."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _kv_blocks(engine: Engine) -> tuple[int, int]:
    """(used, usable) KV blocks: the engine's own notion, so used / usable is its kv_usage()."""
    usable = engine.profile.usable_blocks()
    return usable - engine.kv.num_free_blocks, usable


class SGLangPages:
    """SGLang's /metrics (launched with --enable-metrics): queue, running count, token use and the cache geometry,
    each labelled with the served `model_name`, read from the engine at scrape time."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.labels = _label_list(("model_name", model_name))
        p = engine.profile
        self.info = _label_list(("model_name", model_name), ("page_size", str(p.block_size)),
                                ("num_pages", str(p.usable_blocks())))

    def pages(self) -> list[MetricsPage]:
        return [MetricsPage("/metrics", PROMETHEUS_TEXT, self.render)]

    def observe_step(self, result: StepResult) -> None:
        """Nothing to record: every gauge is read live."""

    def observe_finished(self) -> None:
        """Nothing to record: every gauge is read live."""

    def render(self) -> bytes:
        e, labels = self.engine, self.labels
        used, _usable = _kv_blocks(e)
        return "".join([
            _gauge_text("sglang:num_running_reqs", "Requests in the running batch.", labels, e.num_running),
            _gauge_text("sglang:num_queue_reqs", "Requests in the waiting queue.", labels, e.num_waiting),
            _gauge_text("sglang:token_usage", "Share of the KV-cache token slots in use.", labels, e.kv_usage()),
            _gauge_text("sglang:num_used_tokens", "KV-cache token slots in use.", labels, used * e.profile.block_size),
            _gauge_text("sglang:cache_config_info", "KV-cache configuration.", self.info, 1.0),
        ]).encode()


@dataclass(frozen=True, slots=True)
class _Iteration:
    """What trtllm-serve reports of one engine iteration (its iteration stats)."""

    iter: int
    latency_ms: float
    active: int
    queued: int
    completed: int
    used_blocks: int
    usable_blocks: int

    def as_json(self, tokens_per_block: int, max_active: int) -> dict[str, object]:
        return {"iter": self.iter, "iterLatencyMS": self.latency_ms, "numActiveRequests": self.active,
                "numQueuedRequests": self.queued, "numCompletedRequests": self.completed,
                "maxNumActiveRequests": max_active, "gpuMemUsage": 0, "cpuMemUsage": 0,
                "kvCacheStats": {"maxNumBlocks": self.usable_blocks, "usedNumBlocks": self.used_blocks,
                                 "freeNumBlocks": self.usable_blocks - self.used_blocks,
                                 "tokensPerBlock": tokens_per_block}}


class TrtllmPages:
    """trtllm-serve's two pages. GET /prometheus/metrics: its iteration gauges hold the stats of the engine as of the
    last request that finished, since trtllm-serve refreshes them only when a request completes (until then the page
    has the startup info alone); labels `model_name`, `engine_type` and, as prometheus_client's multiprocess mode
    writes them, `pid`. GET /metrics: JSON, the iteration stats since the last read (the read drains them)."""

    MAX_QUEUED = 1000  # iteration stats kept for the JSON page between reads

    def __init__(self, engine: Engine, model_name: str, backend: str = "pytorch") -> None:
        self.engine = engine
        pid = ("pid", str(os.getpid()))
        self.labels = _label_list(("model_name", model_name), ("engine_type", backend), pid)
        self.info = _label_list(("model_name", model_name), ("engine_type", backend), ("model", model_name),
                                ("served_model_name", model_name), ("dtype", "auto"), ("quantization", "none"),
                                ("max_model_len", str(engine.profile.max_model_len)), pid)
        self.iterations: deque[_Iteration] = deque(maxlen=self.MAX_QUEUED)
        self.published: _Iteration | None = None
        self._count = 0

    def pages(self) -> list[MetricsPage]:
        return [MetricsPage("/prometheus/metrics", PROMETHEUS_TEXT, self.render),
                MetricsPage("/metrics", "application/json", self.iteration_stats)]

    def _snapshot(self, latency_ms: float, completed: int) -> _Iteration:
        used, usable = _kv_blocks(self.engine)
        return _Iteration(self._count, latency_ms, self.engine.num_running, self.engine.num_waiting, completed,
                          used, usable)

    def observe_step(self, result: StepResult) -> None:
        """Queue this iteration's stats for the JSON page."""
        self.iterations.append(self._snapshot(result.duration * 1000.0, len(result.finished)))
        self._count += 1

    def observe_finished(self) -> None:
        """A request finished: trtllm-serve now publishes the engine's latest stats to its gauges (counts and
        blocks; the gauges show no latency or completion count of the iteration)."""
        self.published = self._snapshot(0.0, 0)

    def iteration_stats(self) -> bytes:
        """GET /metrics: the queued iteration stats, oldest first, and the queue is emptied."""
        p = self.engine.profile
        out = [it.as_json(p.block_size, p.max_num_seqs) for it in self.iterations]
        self.iterations.clear()
        return json.dumps(out).encode()

    def render(self) -> bytes:
        """GET /prometheus/metrics."""
        parts = [_gauge_text("trtllm_model_config_info", "Multiprocess metric", self.info, 1.0)]
        it = self.published
        if it is not None:
            labels, doc = self.labels, "Multiprocess metric"
            parts += [
                _gauge_text("trtllm_num_requests_running", doc, labels, it.active),
                _gauge_text("trtllm_num_requests_waiting", doc, labels, it.queued),
                _gauge_text("trtllm_kv_cache_utilization", doc, labels, it.used_blocks / it.usable_blocks),
                _gauge_text("trtllm_kv_cache_max_blocks", doc, labels, it.usable_blocks),
                _gauge_text("trtllm_kv_cache_used_blocks", doc, labels, it.used_blocks),
                _gauge_text("trtllm_kv_cache_free_blocks", doc, labels, it.usable_blocks - it.used_blocks),
                _gauge_text("trtllm_kv_cache_tokens_per_block", doc, labels, self.engine.profile.block_size),
            ]
        return "".join(parts).encode()
