"""Two base models and their adapters on `picker sim` pods, through real Envoy, in each engine's metric dialect
(vLLM, SGLang, TensorRT-LLM): every request lands on a pod that serves its model (a sim pod answers any other
model with vLLM's 404), a model nothing serves is the picker's 404 `model_not_found`, `GET /v1/models` lists the
pool's union, and pods restarted with another model are followed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from picker_lab.supervisor import process_scope, start_envoy, start_picker, start_sim, wait_until

SIM_FLAGS = ["--profile", "tiny-cpu"]
MODELS = ("llama", "sql-lora", "qwen", "chat-lora")


def ask(url: str, model: str, prompt: str) -> tuple[int, str]:
    """Status, and the picker's error code when it refused (a pod's own 404 has none)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status, ""
    except urllib.error.HTTPError as err:
        error = json.loads(err.read()).get("error", {})
        return err.code, str(error.get("code", "")) if error.get("type") == "picker_error" else "pod"


def listed(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
        return [m["id"] for m in json.loads(response.read())["data"]]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_two_models_and_adapters_route_only_to_their_pods(engine: str) -> None:
    with process_scope(f"models-{engine}") as (logdir, started):
        pools = {}
        for model, adapter in (("llama", "sql-lora"), ("qwen", "chat-lora")):
            sim = start_sim(2, logdir, model=model, name=f"sim-{model}", extra=[
                *SIM_FLAGS, "--engine", engine, "--lora-modules", f"{adapter}=/adapters/{adapter}"])
            started.append(sim.process)
            pools[model] = sim
        pool = pools["llama"].addresses + pools["qwen"].addresses
        flags = ["--metrics-fast-interval", "50ms", "--metrics-slow-interval", "100ms"]
        if engine == "trtllm":
            flags += ["--model-server-metrics-path", "/prometheus/metrics"]
        picker = start_picker(logdir, endpoints=pool, extra=flags)
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pool)
        started.append(envoy.process)
        wait_until(lambda: listed(envoy.url) == sorted(MODELS), 15, "every pod's models learned", picker.process.proc)
        answers = [ask(envoy.url, model, f"{model} question {i} " * 6) for i in range(10) for model in MODELS]
        assert answers == [(200, "")] * 40  # zero misrouted: a wrong pod would have answered 404
        assert ask(envoy.url, "mistral", "nobody serves me") == (404, "model_not_found")
        if engine != "vllm":
            return
        # the qwen pods come back serving llama (same addresses): followed, and qwen is served nowhere any more
        pools["qwen"].process.stop()
        base = int(pools["qwen"].addresses[0].rsplit(":", 1)[1])
        swapped = start_sim(2, logdir, model="llama", name="sim-swapped", base_port=base, extra=SIM_FLAGS)
        started.append(swapped.process)
        wait_until(lambda: ask(envoy.url, "qwen", "still here?") == (404, "model_not_found"), 15,
                   "the restarted pods' new model learned", picker.process.proc)
        assert [ask(envoy.url, "llama", f"after {i} " * 6) for i in range(20)] == [(200, "")] * 20
        assert listed(envoy.url) == ["llama", "sql-lora"]
