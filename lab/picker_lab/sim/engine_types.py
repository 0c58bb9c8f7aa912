"""What a simulated engine is given and gives back (picker_lab/sim/engine.py): a request, a finished one, one step's
outputs, and its running totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from picker.kvevents.events import KVEvent


@dataclass(slots=True)
class SimRequest:
    """What the engine needs of one generation request (one choice of an OpenAI request)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    remote_prefill: bool = False  # P/D: the prompt's KV comes from a prefill pod (loaded, not computed)


@dataclass(slots=True)
class FinishedRequest:
    """Timings and counts of a finished request (model time), enough for every vLLM request histogram."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    output_token_ids: list[int]
    num_cached_tokens: int
    max_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    num_preemptions: int
    lora_name: str | None

    @property
    def ttft(self) -> float | None:
        """Time to first token, or None when aborted before it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class StepResult:
    """What one engine step did; all outputs happen at `end`."""

    start: float
    duration: float
    end: float
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_scheduled_tokens: int = 0
    first_tokens: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # model-time TTFT of each request in first_tokens
    new_tokens: list[tuple[str, int]] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)
    loaded_loras: list[str] = field(default_factory=list)


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters behind the vLLM counter metrics."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    external_queries: int = 0  # prompt tokens asked of a KV connector (P/D decode requests)
    external_hits: int = 0  # of which loaded from a prefill pod instead of computed
    prompt_tokens_external: int = 0  # prompt tokens of started requests loaded from a prefill pod
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
