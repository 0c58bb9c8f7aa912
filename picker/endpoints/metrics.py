"""A model server's metrics page -> EndpointMetrics: vLLM's names (0.32; tests/data has real pages), SGLang's, or
TensorRT-LLM's (trtllm-serve's Prometheus page, or its JSON iteration stats); `parse_metrics` tells them apart from the
page itself (a JSON list, or the `vllm:` / `sglang:` / `trtllm_` prefixes).

Hand-rolled because it runs on every scrape of every pod (down to 100 ms apart): one regex pass finds only the sample lines of the few series
we use (the name is followed by `{` or a space, and the match must start a line, which drops `# HELP`/`# TYPE`),
so the histogram buckets that make up most of the text are never split into lines or labels. Series of several engines
(data-parallel ranks, label `engine`) add up, KV usage is their mean, and each engine's own are kept beside them.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator

from picker.endpoints.state import EndpointMetrics

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

_SUMMED = {
    "num_requests_waiting": "waiting",
    "num_requests_running": "running",
    "prefix_cache_queries_total": "prefix_queries",
    "prefix_cache_hits_total": "prefix_hits",
    "request_prefill_kv_computed_tokens_sum": "prefill_tokens",
    "request_prefill_time_seconds_sum": "prefill_seconds",
    "request_prefill_time_seconds_count": "prefill_count",
    "time_to_first_token_seconds_sum": "ttft_seconds",
    "time_to_first_token_seconds_count": "ttft_count",
    "request_prompt_tokens_sum": "prompt_tokens",
    "request_prompt_tokens_count": "prompt_count",
}
_KV = ("kv_cache_usage_perc", "gpu_cache_usage_perc")  # the second is the pre-0.10 name
_WANTED = (*_SUMMED, *_KV, "cache_config_info", "lora_requests_info")
# Asking vLLM for only these (prometheus_client's `name[]` filter) spares the pod rendering the ~50 KB page, most of
# it histogram buckets, on every scrape; a page that took the filter always carries the queue gauge.
VLLM_READ_SERIES = tuple(f"vllm:{name}" for name in _WANTED)
VLLM_FILTER_MARK = "vllm:num_requests_waiting"
# No ^ anchor: an anchored multi-line pattern is tried at every offset (7x slower); line starts are checked below.
_SAMPLE = re.compile(r"vllm:(" + "|".join(_WANTED) + r")([{ ][^\n]*)")


def only_named_samples(page: str, names: list[str]) -> str:
    """The page cut down to the samples whose names are listed, as prometheus_client's exposition app answers
    `?name[]=...` (vLLM 0.32 serves that at `/metrics/`): metadata lines go, every label set of a name stays. What
    the echo and simulated pods answer, and what tests cut real pages with."""
    wanted = set(names)
    return "".join(line + "\n" for line in page.splitlines()
                   if line and not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] in wanted)


@functools.lru_cache(maxsize=1024)
def parse_labels(text: str) -> dict[str, str]:
    """Labels of one sample (`a="x",b="y"`), with Prometheus escapes undone.

    Cached (callers must not mutate the result): the info series we read (`cache_config_info`, ~1.5 KB of
    labels) repeat verbatim on every scrape of a pod, and parsing them was a third of the parse time.
    """
    out: dict[str, str] = {}
    for key, value in _LABEL.findall(text):
        if "\\" in value:
            value = value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        out[key] = value
    return out


def _split_sample(rest: str) -> tuple[str, float] | None:
    """(raw label text, value) from what follows a sample's name; None if it is malformed."""
    labels = ""
    if rest.startswith("{"):
        close = rest.rfind("}")  # label values may hold spaces or braces; the value never does
        if close == -1:
            return None
        labels = rest[1:close]
        rest = rest[close + 1 :]
    parts = rest.split()
    if not parts:
        return None
    try:
        return labels, float(parts[0])
    except ValueError:
        return None


def _samples(pattern: re.Pattern[str], text: str) -> Iterator[tuple[str, str, float]]:
    """(series name, raw label text, value) of every sample line `pattern` finds: matches that do not start a line
    (inside `# HELP`/`# TYPE`) and malformed samples are skipped."""
    for match in pattern.finditer(text):
        start = match.start()
        if start and text[start - 1] != "\n":
            continue
        name, rest = match.groups()
        sample = _split_sample(rest)
        if sample is not None:
            yield name, sample[0], sample[1]


def _adapters(text: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in text.split(",")) if a)


class _Engine:
    """The samples of one engine (or of the whole page) added up as they are read."""

    __slots__ = ("sums", "kv_total", "kv_count", "block_size", "gpu_blocks", "models", "described")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(_SUMMED.values(), 0.0)
        self.kv_total = 0.0
        self.kv_count = 0
        self.block_size: int | None = None
        self.gpu_blocks = 0
        self.models: set[str] = set()
        self.described = False  # its cache geometry was read (vLLM gives every engine it runs a cache_config_info)

    def add(self, name: str, info: dict[str, str] | None, value: float) -> None:
        field = _SUMMED.get(name)
        if field is not None:
            if not math.isnan(value):
                self.sums[field] += value
            if field == "running" and info is not None:  # one series per engine: which model it serves
                model = info.get("model_name")
                if model:
                    self.models.add(model)
        elif name in _KV:
            if not math.isnan(value):
                self.kv_total += value
                self.kv_count += 1
        elif info is not None:  # cache_config_info
            self.described = True
            size = _int(info.get("block_size"))
            if size and self.block_size is None:
                self.block_size = size
            self.gpu_blocks += _int(info.get("num_gpu_blocks")) or 0

    def metrics(self, updated_at: float) -> EndpointMetrics:
        sums = self.sums
        m = EndpointMetrics(
            waiting=sums["waiting"], running=sums["running"], prefix_queries=sums["prefix_queries"],
            prefix_hits=sums["prefix_hits"], prefill_tokens=sums["prefill_tokens"],
            prefill_seconds=sums["prefill_seconds"], prefill_count=sums["prefill_count"],
            ttft_seconds=sums["ttft_seconds"], ttft_count=sums["ttft_count"], prompt_tokens=sums["prompt_tokens"],
            prompt_count=sums["prompt_count"], block_size=self.block_size, num_gpu_blocks=self.gpu_blocks or None,
            models=frozenset(self.models), updated_at=updated_at)
        if self.kv_count:
            m.kv_usage = self.kv_total / self.kv_count
        return m


def parse_vllm_metrics(text: str, updated_at: float = -1.0) -> EndpointMetrics:
    """Parse a vLLM exposition; missing series leave the EndpointMetrics defaults. A page of two or more engines
    (label `engine`, as vLLM labels its data-parallel ranks) that describes each one's cache (vLLM writes a
    `cache_config_info` for every engine it runs) also gives each engine's own series (`engines`)."""
    total = _Engine()
    engines: dict[str, _Engine] = {}
    newest_lora = -math.inf
    lora_labels: str | None = None
    for name, labels, value in _samples(_SAMPLE, text):
        if name == "lora_requests_info":
            if value > newest_lora:  # the value is a timestamp, newest series wins
                newest_lora = value
                lora_labels = labels
            continue
        info = parse_labels(labels) if labels else None
        total.add(name, info, value)
        engine = info.get("engine") if info is not None else None
        if engine:
            own = engines.get(engine)
            if own is None:
                own = engines[engine] = _Engine()
            own.add(name, info, value)
    m = total.metrics(updated_at)
    if len(engines) > 1:  # ranks: the engines whose cache the page describes (a rank's index needs its bound)
        split = {int(key): own.metrics(updated_at) for key, own in engines.items() if key.isdigit() and own.described}
        if len(split) > 1:
            m.engines = split
    if lora_labels is not None:
        info = parse_labels(lora_labels)
        m.max_lora = _int(info.get("max_lora")) or 0
        m.running_loras = _adapters(info.get("running_lora_adapters", ""))
        m.waiting_loras = _adapters(info.get("waiting_lora_adapters", ""))
        for own_metrics in (m.engines or {}).values():  # vLLM labels adapter slots per server, not per engine
            own_metrics.max_lora, own_metrics.running_loras = m.max_lora, m.running_loras
            own_metrics.waiting_loras = m.waiting_loras
    return m


# SGLang's names for the same signals (its --enable-metrics page): queue, running, KV-cache use (a 0..1 share).
_SGLANG = re.compile(r"sglang:(num_queue_reqs|num_running_reqs|token_usage|cache_config_info)([{ ][^\n]*)")


def parse_metrics(text: str, updated_at: float = -1.0) -> EndpointMetrics:
    """The engine is read from the page itself: vLLM's (any `vllm:` series; a vLLM page may mention `trtllm_` in a
    config label, so it is tested first), SGLang's (`sglang:`), trtllm-serve's Prometheus page (`trtllm_`) or its
    JSON iteration stats (a list). The vLLM path costs one prefix test and one substring search more than before."""
    if text.startswith("["):
        return parse_trtllm_iteration_stats(text, updated_at)
    if "vllm:" not in text:
        if "sglang:" in text:
            return parse_sglang_metrics(text, updated_at)
        if "trtllm_" in text:
            return parse_trtllm_metrics(text, updated_at)
    return parse_vllm_metrics(text, updated_at)


def parse_sglang_metrics(text: str, updated_at: float = -1.0) -> EndpointMetrics:
    """SGLang: `num_queue_reqs` (waiting), `num_running_reqs` (running, and its `model_name` label: the model
    served), `token_usage` (KV-cache use), `cache_config_info` (`page_size`, `num_pages`) when it exports it. Series
    of several ranks add up; KV use is their mean. SGLang reports no prefix-cache counters of vLLM's kind."""
    m = EndpointMetrics(updated_at=updated_at)
    waiting = running = kv_total = 0.0
    kv_count = 0
    models: set[str] = set()
    for name, labels, value in _samples(_SGLANG, text):
        if math.isnan(value):
            continue
        if name == "num_queue_reqs":
            waiting += value
        elif name == "num_running_reqs":
            running += value
            model = parse_labels(labels).get("model_name")
            if model:
                models.add(model)
        elif name == "token_usage":
            kv_total += value
            kv_count += 1
        else:
            info = parse_labels(labels)
            m.block_size = m.block_size or _int(info.get("page_size"))
            m.num_gpu_blocks = (m.num_gpu_blocks or 0) + (_int(info.get("num_pages")) or 0) or None
    m.waiting, m.running, m.models = waiting, running, frozenset(models)
    if kv_count:
        m.kv_usage = kv_total / kv_count
    return m


# trtllm-serve's Prometheus page (GET /prometheus/metrics, served with `return_perf_metrics`; the iteration gauges
# also need `enable_iter_perf_stats`): its queue, running count, KV use (used / max blocks, 0..1), cache geometry and
# the model it serves (`model_config_info`, logged at startup, so the model is known before any request).
_TRTLLM = re.compile(r"trtllm_(num_requests_waiting|num_requests_running|kv_cache_utilization|kv_cache_max_blocks"
                     r"|kv_cache_tokens_per_block|model_config_info)([{ ][^\n]*)")
# What trtllm-serve put in `model_name` before it filled the label in: no model, rather than a model named so.
_NO_MODEL = frozenset({"", "undefined"})


def parse_trtllm_metrics(text: str, updated_at: float = -1.0) -> EndpointMetrics:
    """trtllm-serve: `num_requests_waiting`, `num_requests_running`, `kv_cache_utilization` (mean over series),
    `kv_cache_max_blocks` and `kv_cache_tokens_per_block`, the model from the series' `model_name` label. Its
    gauges are per process (a `pid` label, prometheus_client's multiprocess mode); several series add up."""
    m = EndpointMetrics(updated_at=updated_at)
    waiting = running = kv_total = 0.0
    kv_count = blocks = 0
    models: set[str] = set()
    for name, labels, value in _samples(_TRTLLM, text):
        if not math.isfinite(value):  # block counts become ints: no NaN, no infinity
            continue
        if name == "num_requests_waiting":
            waiting += value
        elif name == "kv_cache_utilization":
            kv_total += value
            kv_count += 1
        elif name == "kv_cache_max_blocks":
            blocks += int(value)
        elif name == "kv_cache_tokens_per_block":
            m.block_size = m.block_size or int(value) or None
        elif name == "num_requests_running":
            running += value
            models.update(_trtllm_model(labels))
        else:  # model_config_info: logged at startup, before the gauges have their first sample
            models.update(_trtllm_model(labels))
    m.waiting, m.running, m.models = waiting, running, frozenset(models)
    m.num_gpu_blocks = blocks or None
    if kv_count:
        m.kv_usage = kv_total / kv_count
    return m


def _trtllm_model(labels: str) -> tuple[str, ...]:
    model = parse_labels(labels).get("model_name", "")
    return () if model in _NO_MODEL else (model,)


def parse_trtllm_iteration_stats(text: str, updated_at: float = -1.0) -> EndpointMetrics:
    """trtllm-serve's JSON GET /metrics: the iteration stats queued since the last read (the read drains them), one
    object per engine iteration. The newest one counts: `numQueuedRequests`, `numActiveRequests` and `kvCacheStats`
    (`usedNumBlocks` of `maxNumBlocks`, `tokensPerBlock`). An empty list means no iteration ran since the last read:
    an idle engine. It names no model. ValueError if the text is not such a list (the scraper's failure path)."""
    try:
        stats = json.loads(text)
    except RecursionError:  # nested past Python's limit: as unreadable as malformed JSON
        raise ValueError("trtllm iteration stats: nested too deep") from None
    if not isinstance(stats, list):
        raise ValueError("trtllm iteration stats: not a JSON list")
    m = EndpointMetrics(updated_at=updated_at)
    newest = _newest_iteration(stats)
    if newest is None:
        return m
    m.waiting = _number(newest, "numQueuedRequests") or 0.0
    m.running = _number(newest, "numActiveRequests") or 0.0
    kv = newest.get("kvCacheStats")
    if isinstance(kv, dict):
        total = _number(kv, "maxNumBlocks")
        used = _number(kv, "usedNumBlocks")
        if used is None and total is not None and (free := _number(kv, "freeNumBlocks")) is not None:
            used = total - free
        if total:
            m.num_gpu_blocks = int(total)
            m.kv_usage = min(1.0, max(0.0, (used or 0.0) / total))
        m.block_size = int(_number(kv, "tokensPerBlock") or 0) or None
    return m


def _newest_iteration(stats: list[object]) -> dict[str, object] | None:
    """The entry with the highest `iter` (the queue is in order, but a reader should not depend on it)."""
    newest: dict[str, object] | None = None
    newest_iter = -math.inf
    for entry in stats:
        if isinstance(entry, dict):
            iteration = _number(entry, "iter") or 0.0
            if iteration >= newest_iter:
                newest, newest_iter = entry, iteration
    return newest


def _number(obj: dict[str, object], key: str) -> float | None:
    """A finite number under `key` (JSON has no NaN, but bools are ints in Python and must not count)."""
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _int(text: str | None) -> int | None:
    if not text:
        return None
    try:
        return int(float(text))
    except ValueError:
        return None
