"""Prefill/decode disaggregation on two real vLLM servers, end to end (opt-in: vLLM 0.32 CPU, ~5 minutes)

    make pd-real     # or: .venv/bin/python bench/pd_real.py [--long 6 --short 4]

Starts a prefill server and a decode server (bench/.venvs/vllm, the benchmark's small local model, one core each)
with vLLM's ExampleConnector (`kv_role: kv_both`, KV blocks written to and read from one shared directory), the
decode server behind `picker pd-sidecar --kv-connector shared-storage`, the picker with a P/D config (the prefill
server labelled `prefill`, the sidecar `decode`) and Envoy in front. Sends unique long prompts (disaggregated: the
picker names the prefill server) and short ones (decode-only), then the same number of long prompts straight to
the decode server as the cold control. Reports, from the servers' own counters, that the prefill server computed
the long prompts and the decode server loaded them (vllm:prompt_tokens_by_source_total{source=
"external_kv_transfer"}) instead of computing them, the picker's decision counts, and TTFTs. Writes
bench/out/pd_real.md and .json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from picker_lab.bench import vllm_engine as engine  # noqa: E402
from picker_lab.bench.disagg import pd_scheduling  # noqa: E402
from picker_lab.supervisor import (  # noqa: E402
    HOST,
    free_port,
    port_open,
    process_scope,
    python_module,
    spawn,
    start_envoy,
    start_picker,
    wait_until,
)

BLOCK, BLOCKS = 64, 160
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")


def counters(url: str) -> dict[str, float]:
    """The counters above and prompt tokens by source, each summed over its series."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = name
        if name == "vllm:prompt_tokens_by_source_total":
            key = name + ":" + line.split('source="', 1)[1].split('"', 1)[0]
        elif name not in COUNTERS:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def first_token(url: str, prompt: str, max_tokens: int) -> float:
    """Seconds to the first streamed token of a completion, read to its end (a stream left early is aborted)."""
    body = {"model": engine.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    began = time.perf_counter()
    first: float | None = None
    with urllib.request.urlopen(request, timeout=600) as response:
        assert response.status == 200, response.status
        for raw in response:
            line = raw.decode().strip()
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def measure(args: argparse.Namespace) -> dict[str, Any]:
    engine.install()
    model = engine.build_model(engine.SMALL)
    rng = random.Random(args.seed)
    vocabulary = engine.vocabulary()

    def prompt(words: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(words))

    shared = Path(tempfile.mkdtemp(prefix="picker-pd-kv-"))
    connector = ["--kv-transfer-config", json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(shared)}})]
    with process_scope("pd-real") as (logdir, started):
        servers = [engine.start_server(logdir, block_size=BLOCK, num_blocks=BLOCKS, name=name, model_dir=model,
                                       cpu=cpu, extra=connector) for cpu, name in enumerate(("prefill", "decode"))]
        try:
            for server in servers:
                server.wait_healthy()
            prefill, decode = servers
            sidecar_port, sidecar_metrics = free_port(), free_port()
            started.append(spawn("sidecar", [*python_module("picker"), "pd-sidecar", "--host", HOST,
                                             "--port", str(sidecar_port), "--model-server-port", str(decode.port),
                                             "--kv-connector", "shared-storage", "--metrics-port",
                                             str(sidecar_metrics)], logdir))
            wait_until(lambda: port_open(sidecar_port), 20, "sidecar")
            sidecar = f"{HOST}:{sidecar_port}"
            endpoints = logdir / "endpoints.yaml"
            endpoints.write_text(yaml.safe_dump([{"address": sidecar, "labels": {"llm-d.ai/role": "decode"}},
                                                 {"address": prefill.address, "labels": {"llm-d.ai/role": "prefill"}}]))
            config = logdir / "picker.yaml"
            config.write_text(yaml.safe_dump({"scheduling": pd_scheduling(args.non_cached_tokens)}))
            picker = start_picker(logdir, endpoints_file=endpoints, extra=["--config-file", str(config)])
            started.append(picker.process)
            envoy = start_envoy(logdir, picker, [sidecar, prefill.address])
            started.append(envoy.process)
            before = {"prefill": counters(prefill.url), "decode": counters(decode.url)}
            long_ttft = [first_token(envoy.url, prompt(args.long_words), args.max_tokens) for _ in range(args.long)]
            after_long = {"prefill": counters(prefill.url), "decode": counters(decode.url)}
            short_ttft = [first_token(envoy.url, prompt(args.short_words), args.max_tokens) for _ in range(args.short)]
            after_short = {"prefill": counters(prefill.url), "decode": counters(decode.url)}
            cold_ttft = [first_token(decode.url, prompt(args.long_words), args.max_tokens) for _ in range(args.long)]
            after_cold = counters(decode.url)
            with urllib.request.urlopen(f"http://{HOST}:{picker.metrics_port}/metrics", timeout=5) as response:
                decisions = {line.split('decision_type="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                             for line in response.read().decode().splitlines()
                             if line.startswith("llm_d_epp_disagg_decision_total{")}
            with urllib.request.urlopen(f"http://{HOST}:{sidecar_metrics}/metrics", timeout=5) as response:
                sidecar_counts = {line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
                                  for line in response.read().decode().splitlines()
                                  if line.startswith("picker_pd_sidecar_") and "_total{" in line}
        finally:
            for server in servers:
                server.stop()
    return {
        "config": {"long_prompts": args.long, "long_words": args.long_words, "short_prompts": args.short,
                   "short_words": args.short_words, "max_tokens": args.max_tokens,
                   "non_cached_tokens": args.non_cached_tokens, "block": BLOCK, "blocks": BLOCKS,
                   "model": engine.SMALL.name, "connector": "ExampleConnector (shared directory)"},
        "long": {"prefill": delta(after_long["prefill"], before["prefill"]),
                 "decode": delta(after_long["decode"], before["decode"]), "ttft_s": long_ttft},
        "short": {"prefill": delta(after_short["prefill"], after_long["prefill"]),
                  "decode": delta(after_short["decode"], after_long["decode"]), "ttft_s": short_ttft},
        "cold_control": {"decode": delta(after_cold, after_short["decode"]), "ttft_s": cold_ttft},
        "decisions": decisions, "sidecar": sidecar_counts,
    }


def render(r: dict[str, Any]) -> str:
    c = r["config"]

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.0f} ms (min {min(values) * 1e3:.0f}, max {max(values) * 1e3:.0f})"

    def source(part: dict[str, float], name: str) -> int:
        return int(part.get(f"vllm:prompt_tokens_by_source_total:{name}", 0))

    def engine_ttft(part: dict[str, float]) -> str:
        count = part.get("vllm:time_to_first_token_seconds_count", 0)
        return f"{part.get('vllm:time_to_first_token_seconds_sum', 0) / count * 1e3:.0f} ms" if count else "-"

    lines = [f"# P/D on two real vLLM CPU servers ({c['model']}, {c['connector']}, block {c['block']})", "",
             f"{c['long_prompts']} unique prompts of {c['long_words']} words and {c['short_prompts']} of "
             f"{c['short_words']} through Envoy + picker (nonCachedTokens {c['non_cached_tokens']}) + `picker "
             f"pd-sidecar`, then {c['long_prompts']} long ones straight to the decode server (cold control); "
             f"{c['max_tokens']} output tokens each.", "",
             "| phase | prefill server: prompt tokens computed / requests | decode server: computed / loaded from "
             "the prefill (external_kv_transfer) / requests | decode server's own TTFT (mean) | client TTFT median "
             "(range) |", "|---|---|---|---|---|"]
    for phase in ("long", "short"):
        p, d = r[phase]["prefill"], r[phase]["decode"]
        lines.append(f"| {phase} via picker | {source(p, 'local_compute')} / "
                     f"{int(p.get('vllm:request_success_total', 0))} | {source(d, 'local_compute')} / "
                     f"{source(d, 'external_kv_transfer')} / {int(d.get('vllm:request_success_total', 0))} | "
                     f"{engine_ttft(d)} | {ms(r[phase]['ttft_s'])} |")
    d = r["cold_control"]["decode"]
    lines.append(f"| long, straight to decode (cold) | - | {source(d, 'local_compute')} / "
                 f"{source(d, 'external_kv_transfer')} / {int(d.get('vllm:request_success_total', 0))} | "
                 f"{engine_ttft(d)} | {ms(r['cold_control']['ttft_s'])} |")
    lines += ["", f"Picker decisions (llm_d_epp_disagg_decision_total): {r['decisions']}; sidecar: {r['sidecar']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--long", type=int, default=6, help="long prompts through the picker (and cold, direct)")
    parser.add_argument("--long-words", type=int, default=450, help="words per long prompt (~1,000 tokens)")
    parser.add_argument("--short", type=int, default=4, help="short prompts through the picker")
    parser.add_argument("--short-words", type=int, default=20, help="words per short prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--non-cached-tokens", type=int, default=256, help="the decider's threshold")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = parser.parse_args()
    result = measure(args)
    engine.write_outputs(args.out, "pd_real", result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
