"""Named hardware/model profiles for the simulated vLLM engine.

Every number here is either read from a real vLLM capture (`tests/data/vllm-0.32-*.txt`) or derived from
public hardware figures; the reasoning sits next to each value so a reader can judge (and change) it. Routing
quality depends mostly on the *ratios* (cache size vs. working set, prefill cost vs. decode cost), so those are
what the comments justify.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Profile:
    """Capacity, scheduler limits and a linear step-time model for one simulated vLLM instance."""

    name: str
    model: str
    # --- KV cache (vllm:cache_config_info) ---
    block_size: int
    num_gpu_blocks: int  # includes vLLM's reserved null block: usable blocks = num_gpu_blocks - 1
    max_model_len: int
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    # --- scheduler ---
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    # --- step time model, seconds (see batch.step_duration) ---
    step_overhead_s: float  # fixed cost of one forward pass (weights read once per step)
    prefill_seq_s: float  # per sequence with a prefill chunk in the step (input preparation, sampler setup)
    prefill_token_s: float  # per prefill token: dense matmuls
    prefill_attn_s: float  # per (prefill token x context token) pair: attention
    decode_seq_s: float  # per decoding sequence in the batch
    decode_ctx_token_s: float  # per context token of decoding sequences: KV reads
    lora_load_s: float  # loading one adapter into a GPU slot
    # --- LoRA ---
    max_loras: int
    # --- sampling ---
    vocab_size: int
    eos_mean_tokens: int | None  # None: never stop at a pseudo-EOS (like a random-weight model)
    # --- API server ---
    # Seconds one GET /metrics holds the pod's API server loop, which also takes in requests and streams tokens.
    # bench/scrape_cost.py measures 4.4-6.7 ms of CPU per scrape on vLLM 0.32 (CPU); 0 keeps scrapes free.
    scrape_cost_s: float = 0.0
    # P/D: loading one prompt token's KV from a prefill pod, as a fraction of computing it (prefill_token_s)
    kv_transfer_cost: float = 0.05
    # KV offloading to host memory (vLLM's OffloadingConnector, CPU tier): its size in blocks (0: none), and
    # loading one token's KV from it as a fraction of computing it. Llama-3-8B keeps 128 KiB of KV per token
    # (32 layers x 8 KV heads x 128 x 2 x fp16); at ~32 GB/s host-to-device over PCIe Gen5 that is ~4 us,
    # against ~40 us of prefill compute per token on an H100 (prefill_token_s): 0.1.
    num_cpu_blocks: int = 0
    host_load_cost: float = 0.1

    def usable_blocks(self) -> int:
        """Blocks requests can use (vLLM keeps block 0 as the null block)."""
        return self.num_gpu_blocks - 1

    def with_overrides(self, **overrides: object) -> Profile:
        """A copy with some fields replaced; unknown names raise so typos in CLI flags are caught."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        clean = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **clean)  # type: ignore[arg-type]

    def slower(self, factor: float) -> Profile:
        """A copy whose forward passes take `factor` times as long (every term of the step time model): an engine
        that gets 1/`factor` of its core, the rest taken by processes sharing it."""
        return replace(self, step_overhead_s=self.step_overhead_s * factor, prefill_seq_s=self.prefill_seq_s * factor,
                       prefill_token_s=self.prefill_token_s * factor, prefill_attn_s=self.prefill_attn_s * factor,
                       decode_seq_s=self.decode_seq_s * factor, decode_ctx_token_s=self.decode_ctx_token_s * factor)


# Llama-3-8B / 3.1-8B (bf16, same architecture) on one H100-80GB, vLLM V1 defaults. Served as Llama 3.1, the
# name the demo, the manifests and every README example use.
LLAMA3_8B_H100 = Profile(
    name="llama3-8b-h100",
    model="meta-llama/Llama-3.1-8B-Instruct",
    # vLLM's default block size on CUDA is 16 tokens.
    block_size=16,
    # KV bytes per token = layers 32 x kv_heads 8 x head_dim 128 x (K+V) 2 x bf16 2 B = 128 KiB.
    # Memory for KV = 80 GB x 0.92 (vLLM 0.32's default gpu_memory_utilization) - 16.1 GB weights - ~2.5 GB
    # activations/CUDA graphs ~= 55 GB -> 420k tokens -> 26,225 blocks of 16; rounded down to 26,000.
    num_gpu_blocks=26_000,
    # Llama-3-8B's native context window.
    max_model_len=8192,
    kv_cache_memory_bytes=26_000 * 16 * 131_072,
    gpu_memory_utilization=0.92,
    # vLLM 0.32 API-server defaults for >= 70 GiB GPUs other than A100 (engine/arg_utils.py): 1024 sequences,
    # 8192 batched tokens; chunked prefill on.
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    enable_chunked_prefill=True,
    # A step streams all 16 GB of weights from HBM (3.35 TB/s) -> ~5 ms; measured single-sequence ITL for 8B on
    # H100 is ~6-7 ms, so 6 ms of fixed cost per step.
    step_overhead_s=0.006,
    # Per-request prefill setup is small next to the matmuls on a GPU.
    prefill_seq_s=0.2e-3,
    # 2 x 8e9 FLOP per token at ~400 TFLOP/s effective bf16 -> 40 us per prefill token (2k-token prefill ~ 85 ms
    # including overhead, in line with published TTFTs).
    prefill_token_s=40e-6,
    # Attention: 4 x layers 32 x hidden 4096 ~= 0.5 MFLOP per (query, key) pair at ~500 TFLOP/s -> ~1 ns.
    prefill_attn_s=1.0e-9,
    # Sampling, scheduling and small per-sequence kernels: ~30 us per running sequence.
    decode_seq_s=30e-6,
    # Each decode reads the sequence's KV: 128 KiB per token at ~3 TB/s -> ~40 ns per context token.
    decode_ctx_token_s=40e-9,
    # A rank-16 adapter for 8B is ~30-80 MB; a host->GPU copy plus setup ~ 20 ms.
    lora_load_s=0.020,
    # vLLM's default --max-loras.
    max_loras=1,
    vocab_size=128_256,
    eos_mean_tokens=None,
)

# The CPU vLLM 0.32.0 that produced tests/data/vllm-0.32-cpu-idle.txt: a tiny random-weight
# Llama served as "tiny".
TINY_CPU = Profile(
    name="tiny-cpu",
    model="tiny",
    # cache_config_info: block_size="128" (vLLM's CPU default).
    block_size=128,
    # cache_config_info: num_gpu_blocks="8192", kv_cache_memory_bytes="1073741824" (VLLM_CPU_KVCACHE_SPACE=1).
    num_gpu_blocks=8192,
    # kv_cache_size_tokens 1048576 / kv_cache_max_concurrency 256 = 4096.
    max_model_len=4096,
    kv_cache_memory_bytes=1_073_741_824,
    gpu_memory_utilization=0.92,  # cache_config_info label of the capture
    # vLLM 0.32's CPU defaults for the API server (engine/arg_utils.py): 128 sequences, 2048 batched tokens.
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    enable_chunked_prefill=True,
    # From the capture: 17 inter-token latencies sum to 62.8 ms -> ~3.7 ms per decode step of one sequence.
    step_overhead_s=0.0036,
    # Fitted to TTFTs of the real CPU server measured by bench/validate_sim.py (token-id prompts of 100-1000 tokens,
    # cold and partly cached): TTFT ~= 11.4 ms + 77 us x new tokens + 69 ns x (new token x context token) pairs.
    # The 11.4 ms minus the decode step (3.6 ms) and our own HTTP overhead (~1.5 ms) is per-prefill setup.
    prefill_seq_s=0.0063,
    prefill_token_s=77e-6,
    prefill_attn_s=6.9e-8,
    decode_seq_s=0.1e-3,
    decode_ctx_token_s=1e-8,
    # bench/validate_sim.py: the first request through a fresh rank-8 adapter took ~150 ms longer than the same
    # prompt on the base model (loading from disk on CPU).
    lora_load_s=0.15,
    # The LoRA capture shows max_lora="2".
    max_loras=2,
    # bench/validate_sim.py trains a tokenizer of this size for the real tiny model.
    vocab_size=4096,
    eos_mean_tokens=None,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (LLAMA3_8B_H100, TINY_CPU)}
DEFAULT_PROFILE = LLAMA3_8B_H100.name


def get_profile(name: str) -> Profile:
    """Look a profile up by name; the error lists the valid names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None
