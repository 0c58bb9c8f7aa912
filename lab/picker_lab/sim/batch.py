"""One engine step's batch (picker_lab/sim/engine.py): the state the engine keeps of each request, and what a step
of scheduled requests costs in model time."""

from __future__ import annotations

from picker_lab.sim.engine_types import SimRequest
from picker_lab.sim.profiles import Profile


class RequestState:
    """Mutable per-request engine state."""

    __slots__ = (
        "req",
        "tokens",
        "num_prompt",
        "output",
        "num_computed",
        "blocks",
        "hashes",
        "num_cached_blocks",
        "num_cached_tokens",
        "stream_key",
        "stop_at",
        "arrival",
        "first_scheduled",
        "first_token",
        "last_token",
        "num_preemptions",
        "lora_id",
        "loading",
        "load_cost",
        "num_external",
    )

    def __init__(self, req: SimRequest, arrival: float, stream_key: int, stop_at: int | None, lora_id: int | None):
        self.req = req
        self.tokens = list(req.prompt_token_ids)
        self.num_prompt = len(req.prompt_token_ids)
        self.output: list[int] = []
        self.num_computed = 0
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_cached_blocks = 0  # blocks of self.blocks already registered in the prefix cache
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (usage.prompt_tokens_details)
        self.stream_key = stream_key
        self.stop_at = stop_at
        self.arrival = arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_preemptions = 0
        self.lora_id = lora_id
        self.loading = 0  # tokens of the step being scheduled loaded (from a prefill pod, host memory), not computed
        self.load_cost = 0.0  # loading a token of them, as a fraction of computing it
        self.num_external = 0  # of its cached prompt tokens, those loaded from a prefill pod


def step_duration(p: Profile, scheduled: list[tuple[RequestState, int, int]], num_lora_loads: int) -> float:
    """Linear cost model: overhead + prefills (per sequence, per token, per attention pair) + decodes (per
    sequence, per context token) + LoRA loads."""
    prefill_seqs = 0
    prefill_tokens = 0
    attn_pairs = 0.0
    decode_seqs = 0
    decode_ctx = 0
    loaded = 0.0  # loaded tokens, in computed tokens' worth
    for st, n, ctx in scheduled:
        if st.loading:  # moved from a prefill pod or host memory: a transfer, then only the rest is computed
            loaded += st.loading * st.load_cost
            n -= st.loading
            ctx += st.loading
        if n == 1 and ctx >= st.num_prompt:
            decode_seqs += 1
            decode_ctx += ctx + 1
        else:
            prefill_seqs += 1
            prefill_tokens += n
            attn_pairs += n * (ctx + (n + 1) / 2)
    return (
        p.step_overhead_s
        + prefill_seqs * p.prefill_seq_s
        + prefill_tokens * p.prefill_token_s
        + attn_pairs * p.prefill_attn_s
        + decode_seqs * p.decode_seq_s
        + decode_ctx * p.decode_ctx_token_s
        + num_lora_loads * p.lora_load_s
        + loaded * p.prefill_token_s
    )
