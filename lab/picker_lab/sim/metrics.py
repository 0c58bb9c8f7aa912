"""vLLM 0.32 `/metrics` exposition for one simulated instance, on its own prometheus_client CollectorRegistry.

Names, label sets (sorted alphabetically, as in the captured samples), histogram buckets and `_created` series follow
tests/data/ (pages captured from a real vLLM 0.32). A custom collector renders everything from the engine's counters at scrape time,
so a step costs no Prometheus bookkeeping beyond a few histogram increments.

A pod may speak another engine's metric dialect instead (`picker sim --engine`): SGLang's page, or TensorRT-LLM's
(trtllm-serve's /prometheus/metrics and its JSON /metrics), with the gauges a picker reads and the model served.
`SimMetrics.pages()` is the seam: the routes a pod serves its metrics on, whatever the dialect.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from picker_lab.sim.dialects import PROMETHEUS_TEXT, MetricDialect, MetricsPage, dialect_pages
from picker_lab.sim.engine import Engine, FinishedRequest, StepResult

LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]  # fmt: skip
ITERATION_BUCKETS = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0]
N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
PREEMPTION_BUCKETS = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets depend on max_model_len)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(float(v))
        exponent += 1


class Histogram:
    """Fixed-bucket histogram without label handling (one series per instance)."""

    __slots__ = ("bounds", "counts", "sum", "count", "created")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0
        self.created = time.time()

    def observe(self, value: float) -> None:
        """Add one observation (le semantics: value <= bound)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


def _fmt_bound(b: float) -> str:
    return repr(float(b))


class SimMetrics(Collector):
    """Collects the vLLM metric families of one engine; `registry` is what `/metrics` renders."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        lora_enabled: bool = False,
        prefix_caching_hash_algo: str = "sha256",
        process_metrics: bool = True,
        dialect: MetricDialect = "vllm",
        engine_index: int = 0,
    ) -> None:
        self.engine = engine
        self.engine_index = str(engine_index)  # the `engine` label: a data-parallel server's rank
        self.model_name = model_name
        self.lora_enabled = lora_enabled
        self.hash_algo = prefix_caching_hash_algo
        self.base = {"engine": self.engine_index, "model_name": model_name}
        p = engine.profile
        tok = build_1_2_5_buckets(p.max_model_len)
        self.created = time.time()
        self.h: dict[str, Histogram] = {
            "vllm:request_prompt_tokens": Histogram(tok),
            "vllm:request_generation_tokens": Histogram(tok),
            "vllm:iteration_tokens_total": Histogram(ITERATION_BUCKETS),
            "vllm:request_max_num_generation_tokens": Histogram(tok),
            "vllm:request_params_n": Histogram(N_BUCKETS),
            "vllm:request_params_max_tokens": Histogram(tok),
            "vllm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "vllm:request_time_per_output_token_seconds": Histogram(ITL_BUCKETS),
            "vllm:e2e_request_latency_seconds": Histogram(LATENCY_BUCKETS),
            "vllm:request_queue_time_seconds": Histogram(LATENCY_BUCKETS),
            "vllm:request_inference_time_seconds": Histogram(LATENCY_BUCKETS),
            "vllm:request_prefill_time_seconds": Histogram(LATENCY_BUCKETS),
            "vllm:request_decode_time_seconds": Histogram(LATENCY_BUCKETS),
            "vllm:request_num_preemptions": Histogram(PREEMPTION_BUCKETS),
            "vllm:request_prefill_kv_computed_tokens": Histogram(tok),
        }
        # (running adapters, waiting adapters) -> wall time of the last step that saw that combination
        self.lora_info: dict[tuple[str, str], float] = {}
        self._rendering = False
        self._hist_text: dict[str, tuple[int, str]] = {}  # histogram -> (observations, its rendered text)
        self.registry = CollectorRegistry(auto_describe=False)
        # Process-wide collectors render through prometheus_client; our own families through the faster
        # `exposition_text` (same bytes), because a scrape must not steal the engines' CPU: vLLM serves /metrics
        # from its API server process, apart from the engine core, while all sim pods share one process.
        self.process_registry = CollectorRegistry(auto_describe=False)
        if process_metrics:
            for collector in (GCCollector, PlatformCollector, ProcessCollector):
                collector(registry=self.process_registry)
            self.registry.register(_RegistryView(self.process_registry))
        self.registry.register(self)
        if lora_enabled:
            self._note_lora()
        self.dialect_pages = dialect_pages(dialect, engine, model_name)  # None: vLLM's own page, rendered here

    # --- updates ---------------------------------------------------------------------------------------------
    def observe_step(self, result: StepResult) -> None:
        """Fold one engine step into the histograms (model-time durations)."""
        h = self.h
        h["vllm:iteration_tokens_total"].observe(result.num_scheduled_tokens)
        itl = h["vllm:inter_token_latency_seconds"]
        for v in result.inter_token_latencies:
            itl.observe(v)
        ttft = h["vllm:time_to_first_token_seconds"]
        for v in result.ttfts:
            ttft.observe(v)
        if self.dialect_pages is not None:
            self.dialect_pages.observe_step(result)
        for fin in result.finished:
            self.observe_finished(fin)
        if self.lora_enabled:
            self._note_lora()

    def observe_finished(self, fin: FinishedRequest) -> None:
        """Per-request histograms, observed when a request finishes (or is aborted)."""
        if self.dialect_pages is not None:
            self.dialect_pages.observe_finished()
        h = self.h
        n_out = len(fin.output_token_ids)
        h["vllm:request_prompt_tokens"].observe(fin.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(n_out)
        h["vllm:request_max_num_generation_tokens"].observe(fin.max_tokens)
        h["vllm:request_params_n"].observe(1)
        h["vllm:request_params_max_tokens"].observe(fin.max_tokens)
        h["vllm:e2e_request_latency_seconds"].observe(fin.finish_time - fin.arrival_time)
        h["vllm:request_num_preemptions"].observe(fin.num_preemptions)
        if fin.first_scheduled_time is not None:
            h["vllm:request_queue_time_seconds"].observe(fin.first_scheduled_time - fin.arrival_time)
            h["vllm:request_inference_time_seconds"].observe(fin.finish_time - fin.first_scheduled_time)
            h["vllm:request_prefill_kv_computed_tokens"].observe(fin.prompt_tokens - fin.num_cached_tokens)
            if fin.first_token_time is not None:
                h["vllm:request_prefill_time_seconds"].observe(fin.first_token_time - fin.first_scheduled_time)
                decode = fin.finish_time - fin.first_token_time
                h["vllm:request_decode_time_seconds"].observe(decode)
                if n_out > 1:
                    h["vllm:request_time_per_output_token_seconds"].observe(decode / (n_out - 1))

    def _note_lora(self) -> None:
        # vLLM 0.32 keys both labels by every adapter with an unfinished request (its per-adapter counts may be 0),
        # so running_lora_adapters == waiting_lora_adapters; confirmed against a real server by validate_sim.
        names = ",".join(self.engine.inflight_loras())
        self.lora_info[(names, names)] = time.time()

    # --- exposition ------------------------------------------------------------------------------------------
    def _labels(self, **extra: str) -> dict[str, str]:
        labels = dict(self.base)
        labels.update(extra)
        return dict(sorted(labels.items()))

    def _gauge(self, name: str, doc: str, value: float, **extra: str) -> Metric:
        m = Metric(name, doc, "gauge")
        m.add_sample(name, self._labels(**extra), value)
        return m

    def _counter(self, name: str, doc: str, series: list[tuple[dict[str, str], float]]) -> Metric:
        m = Metric(name, doc, "counter")
        for labels, value in series:
            m.add_sample(name + "_total", labels, float(value))
        for labels, _value in series:
            m.add_sample(name + "_created", labels, self.created)
        return m

    def _hist(self, name: str, doc: str) -> Metric:
        hist = self.h[name]
        if self._rendering:  # scrape path: re-render a histogram only after it changed
            cached = self._hist_text.get(name)
            if cached is None or cached[0] != hist.count:
                cached = (hist.count, exposition_text([self._hist_metric(name, doc, hist)]))
                self._hist_text[name] = cached
            return _Rendered(name, cached[1])
        return self._hist_metric(name, doc, hist)

    def _hist_metric(self, name: str, doc: str, hist: Histogram) -> Metric:
        m = Metric(name, doc, "histogram")
        acc = 0
        for bound, count in zip(hist.bounds, hist.counts, strict=False):
            acc += count
            m.add_sample(name + "_bucket", self._labels(le=_fmt_bound(bound)), float(acc))
        m.add_sample(name + "_bucket", self._labels(le="+Inf"), float(hist.count))
        m.add_sample(name + "_count", self._labels(), float(hist.count))
        m.add_sample(name + "_sum", self._labels(), hist.sum)
        m.add_sample(name + "_created", self._labels(), hist.created)
        return m

    def collect(self) -> Iterator[Metric]:
        """All vllm:* families in the order vLLM 0.32 exposes them."""
        e = self.engine
        s = e.stats
        one = [(self._labels(), 0.0)]
        yield self._counter("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).", one)
        yield self._counter("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).", one)
        yield self._counter("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).", one)
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", e.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        m = Metric("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.", "gauge")
        m.add_sample(m.name, self._labels(reason="capacity"), float(e.num_waiting))
        m.add_sample(m.name, self._labels(reason="deferred"), 0.0)
        yield m
        m = Metric("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", "gauge")
        for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            m.add_sample(m.name, self._labels(sleep_state=state), value)
        yield m
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage())
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", [(self._labels(), s.prefix_cache_queries)])
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", [(self._labels(), s.prefix_cache_hits)])
        yield self._counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", [(self._labels(), s.external_queries)])
        yield self._counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", [(self._labels(), s.external_hits)])
        yield self._counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", one)
        yield self._counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", one)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", [(self._labels(), s.num_preemptions)])
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [(self._labels(), s.prompt_tokens)])
        computed = s.prompt_tokens - s.prompt_tokens_cached
        yield self._counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [
            (self._labels(source="local_compute"), computed),
            (self._labels(source="local_cache_hit"), s.prompt_tokens_cached - s.prompt_tokens_external),
            (self._labels(source="external_kv_transfer"), s.prompt_tokens_external),
        ])  # fmt: skip
        yield self._counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", [(self._labels(), s.prompt_tokens_cached)])
        yield self._counter("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", [
            (self._labels(source="device"), s.prefix_cache_hits),
            (self._labels(source="host"), 0),
            (self._labels(source="p2p"), s.external_hits),
            (self._labels(source="disk"), 0),
            (self._labels(source="external_unspecified"), 0),
        ])  # fmt: skip
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", [(self._labels(), s.generation_tokens)])
        yield self._counter("vllm:request_success", "Count of successfully processed requests.", [
            (self._labels(finished_reason=r), s.finished.get(r, 0)) for r in FINISH_REASONS
        ])  # fmt: skip
        rejections = Metric("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.", "counter")
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.add_sample("vllm:admission_rejections_total", {"model_name": self.model_name, "reason": reason}, 0.0)
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.add_sample("vllm:admission_rejections_created", {"model_name": self.model_name, "reason": reason}, self.created)
        yield rejections
        yield self._hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.")
        yield self._hist("vllm:request_generation_tokens", "Number of generation tokens processed.")
        yield self._hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.")
        yield self._hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.")
        yield self._hist("vllm:request_params_n", "Histogram of the n request parameter.")
        yield self._hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.")
        yield self._hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        yield self._hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.")
        yield self._hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.")
        yield self._hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        yield self._hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.")
        yield self._hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.")
        yield self._hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.")
        yield self._hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.")
        yield self._hist("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.")
        yield self._hist("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).")
        if self.lora_enabled:
            m = Metric("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
            for (running, waiting), stamp in self.lora_info.items():
                m.add_sample(m.name, {"max_lora": str(e.profile.max_loras), "running_lora_adapters": running,
                                      "waiting_lora_adapters": waiting}, stamp)  # fmt: skip
            yield m
        yield self._cache_config_info()

    def _cache_config_info(self) -> Metric:
        p = self.engine.profile
        tokens = p.num_gpu_blocks * p.block_size
        labels = {
            "_block_size_resolved": "True",
            "block_size": str(p.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(p.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(self.engine.kv.enable_prefix_caching),
            "engine": self.engine_index,
            "gpu_memory_utilization": str(p.gpu_memory_utilization),
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(round(tokens / p.max_model_len, 2)),
            "kv_cache_memory_bytes": str(p.kv_cache_memory_bytes),
            "kv_cache_size_tokens": str(tokens),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(p.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": self.hash_algo,
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "False",
        }
        m = Metric("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
        m.add_sample("vllm:cache_config_info", labels, 1.0)
        return m

    def pages(self) -> list[MetricsPage]:
        """The routes this pod serves its metrics on: vLLM's /metrics, or the other dialect's pages."""
        if self.dialect_pages is not None:
            return self.dialect_pages.pages()
        return [MetricsPage("/metrics", PROMETHEUS_TEXT, self.render, takes_names=True)]

    def render(self) -> bytes:
        """vLLM's page: Prometheus text format 0.0.4 of the whole registry (byte-identical to `generate_latest`)."""
        self._rendering = True
        try:
            text = exposition_text(self.collect())
        finally:
            self._rendering = False
        return generate_latest(self.process_registry) + text.encode()


class _Rendered(Metric):
    """A family already in exposition text (an unchanged histogram, from the render cache)."""

    def __init__(self, name: str, text: str) -> None:
        super().__init__(name, "", "histogram")
        self.text = text


class _RegistryView(Collector):
    """Exposes another registry's metrics, so `registry` still holds everything `/metrics` shows."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.inner = registry

    def collect(self) -> Iterator[Metric]:
        return iter(self.inner.collect())


_PROM_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "gauge",
               "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped", "summary": "summary"}
_label_text_cache: dict[tuple[tuple[str, str], ...], str] = {}


def _label_text(labels: dict[str, str]) -> str:
    key = tuple(labels.items())
    text = _label_text_cache.get(key)
    if text is None:
        escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + "n").replace(chr(34), chr(92) + chr(34))}"'
                   for k, v in sorted(labels.items()))
        text = "{" + ",".join(escaped) + "}" if labels else ""
        if len(_label_text_cache) < 100_000:
            _label_text_cache[key] = text
    return text


def exposition_text(metrics: Iterable[Metric]) -> str:
    """Prometheus text format 0.0.4 of plain-named metrics, as prometheus_client's `generate_latest` writes
    it (counter `_total` names, `_created` series split into their own gauge families), but with label strings
    cached: ~10x cheaper for the few hundred samples a vLLM pod exposes."""
    out: list[str] = []
    for metric in metrics:
        if isinstance(metric, _Rendered):
            out.append(metric.text)
            continue
        name = metric.name + ("_total" if metric.type == "counter" else "_info" if metric.type == "info" else "")
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {_PROM_TYPES[metric.type]}\n")
        split: dict[str, list[str]] = {}
        for sample in metric.samples:
            line = f"{sample.name}{_label_text(sample.labels)} {floatToGoString(sample.value)}\n"
            for suffix in ("_created", "_gsum", "_gcount"):
                if sample.name == metric.name + suffix:
                    split.setdefault(suffix, []).append(line)
                    break
            else:
                out.append(line)
        for suffix, lines in sorted(split.items()):
            out.append(f"# HELP {metric.name}{suffix} {doc}\n# TYPE {metric.name}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out)
