"""Prefill/decode disaggregation through real Envoy: the picker names a prefill pod for a long uncached prompt, the
decode pod's sidecar prefills there and decodes with the transferred KV (both pods' counters show it), a short
prompt stays decode-only, each decision is counted, and a dead prefill pod costs a local prefill, not a failure.

Pods are `picker sim` servers, which speak vLLM's KV-connector handshake (`kv_transfer_params`): a prefill asked
to keep its KV answers with transfer parameters, and a decode request carrying them loads the prompt's blocks
instead of computing them (vllm:external_prefix_cache_hits)."""

from __future__ import annotations

import functools
import json
import random
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from picker.core.headers import PREFILLER
from picker_lab.supervisor import (
    HOST,
    Managed,
    free_port,
    metric_sum,
    process_scope,
    spawn,
    start_envoy,
    start_picker,
    start_sim,
    wait_until,
)
from tests.test_data_parallel_envoy import rank_counters, targets
from tests.test_disagg import PD

ROLE = "llm-d.ai/role"
WORDS = ["alpha", "bo", "cider", "delta", "ex", "fox", "gamma", "hi", "iota", "jam"]


counter = metric_sum  # a counter summed over its series (those with `labels`)


def send(url: str, prompt: str, headers: dict[str, str] | None = None) -> dict[str, object]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        answer: dict[str, object] = json.loads(response.read())
        return answer


def prompter(seed: int) -> Callable[[int], str]:
    """Prompts of so many words drawn from WORDS, the same sequence for the same seed."""
    rng = random.Random(seed)
    return lambda words: " ".join(rng.choice(WORDS) for _ in range(words))


def start_sidecar(logdir: Path, started: list[Managed], decoder: str, name: str) -> tuple[str, str]:
    """`picker pd-sidecar` in front of the decode engine at `decoder`: its address and its metrics' address."""
    port, metrics_port = free_port(), free_port()
    started.append(spawn(name, [sys.executable, "-m", "picker", "pd-sidecar", "--host", HOST, "--port", str(port),
                                "--model-server-port", decoder.rsplit(":", 1)[1], "--metrics-port",
                                str(metrics_port)], logdir))
    wait_until(functools.partial(_answers, f"{HOST}:{metrics_port}"), 20, f"sidecar {name}")
    return f"{HOST}:{port}", f"{HOST}:{metrics_port}"


def test_a_long_prompt_is_prefilled_on_the_prefill_pod_and_a_dead_one_costs_a_local_prefill(tmp_path: Path) -> None:
    prompt = prompter(5)
    with process_scope("pd") as (logdir, started):
        decoders = start_sim(2, logdir, model="tiny", extra=["--profile", "tiny-cpu"], name="decoders")
        started.append(decoders.process)
        prefiller = start_sim(1, logdir, model="tiny", extra=["--profile", "tiny-cpu"], name="prefiller")
        started.append(prefiller.process)
        sidecars, sidecar_metrics = zip(*(start_sidecar(logdir, started, decoder, f"sidecar-{i}")
                                          for i, decoder in enumerate(decoders.addresses)), strict=True)
        endpoints = tmp_path / "endpoints.yaml"
        endpoints.write_text(yaml.safe_dump(
            [{"address": a, "labels": {ROLE: "decode"}} for a in sidecars]
            + [{"address": prefiller.addresses[0], "labels": {ROLE: "prefill"}}]))
        config = tmp_path / "picker.yaml"
        config.write_text(yaml.safe_dump({"scheduling": PD}))
        # slow scrapes: the dead prefill pod is still believed ready when the last request comes
        picker = start_picker(logdir, endpoints_file=endpoints, extra=[
            "--config-file", str(config), "--metrics-fast-interval", "5s", "--metrics-slow-interval", "5s",
            "--unhealthy-after-failures", "5"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, [*sidecars, *prefiller.addresses], disaggregation=True)
        started.append(envoy.process)
        prefill_pod = prefiller.addresses[0]
        wait_until(lambda: counter(f"{HOST}:{picker.metrics_port}", "picker_endpoint_state",
                                   state="ready") == 3, 20, "three pods ready", picker.process.proc)
        decisions = f"{HOST}:{picker.metrics_port}"

        send(envoy.url, prompt(600))  # ~3,000 characters, cached nowhere: prefilled on the prefill pod
        assert counter(prefill_pod, "vllm:request_success_total") == 1
        assert counter(prefill_pod, "vllm:generation_tokens_total") == 1  # the prefill leg asks for one token
        loaded = sum(counter(a, "vllm:external_prefix_cache_hits_total") for a in decoders.addresses)
        assert loaded > 0  # the decode pod loaded the prompt's blocks instead of computing them
        assert sum(counter(a, "vllm:request_success_total") for a in decoders.addresses) == 1
        assert counter(decisions, "llm_d_epp_disagg_decision_total", decision_type="prefill-decode") == 1

        # a streamed chat, disaggregated: the prefill leg is a one-token non-streamed call, the answer streams back
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": prompt(600)}], "max_tokens": 8,
                           "stream": True}).encode()
        request = urllib.request.Request(envoy.url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
            events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 3
        assert counter(prefill_pod, "vllm:request_success_total") == 2
        assert counter(decisions, "llm_d_epp_disagg_decision_total", decision_type="prefill-decode") == 2
        loaded = sum(counter(a, "vllm:external_prefix_cache_hits_total") for a in decoders.addresses)

        sent = envoy.ext_proc_messages_sent()
        send(envoy.url, prompt(10))  # short: prefilled where it is decoded
        # with P/D the picker hears every response begin (a prefill pod's count ends there): headers, body, response
        assert envoy.ext_proc_messages_sent() - sent == 3
        assert counter(prefill_pod, "vllm:request_success_total") == 2
        assert sum(counter(a, "vllm:external_prefix_cache_hits_total") for a in decoders.addresses) == loaded
        assert counter(decisions, "llm_d_epp_disagg_decision_total", decision_type="decode-only") == 1
        assert sum(counter(a, "picker_pd_sidecar_requests_total", prefill="remote") for a in sidecar_metrics) == 2
        assert sum(counter(a, "picker_pd_sidecar_requests_total", prefill="local") for a in sidecar_metrics) == 1

        # a client's own prefill target is removed, not honoured: this short prompt is prefilled where it is decoded
        # (had the sidecar seen the header, it would have tried the closed port and counted an unreachable prefill)
        send(envoy.url, prompt(10), {PREFILLER: f"{HOST}:{free_port()}"})
        assert sum(counter(a, "picker_pd_sidecar_requests_total", prefill="local") for a in sidecar_metrics) == 2
        assert sum(counter(a, "picker_pd_sidecar_prefill_fallbacks_total") for a in sidecar_metrics) == 0

        prefiller.process.proc.terminate()
        prefiller.process.proc.wait(10)
        send(envoy.url, prompt(600))  # routed to the dead prefill pod: the sidecar prefills locally
        assert counter(decisions, "llm_d_epp_disagg_decision_total", decision_type="prefill-decode") == 3
        assert sum(counter(a, "picker_pd_sidecar_prefill_fallbacks_total", reason="unreachable")
                   for a in sidecar_metrics) == 1
        assert sum(counter(a, "vllm:external_prefix_cache_hits_total") for a in decoders.addresses) == loaded


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def test_a_prefill_rank_of_a_data_parallel_server_gets_the_prompt_and_keeps_its_prefix(tmp_path: Path) -> None:
    """The prefill pod is a server of two data-parallel ranks: the picker scores each rank, names the one it chose
    in x-prefiller-data-parallel-rank, and the sidecar's prefill leg steers the server to it; a second long prompt
    sharing the first's beginning is prefilled on the same rank, from its cache."""
    prompt = prompter(8)
    with process_scope("pd-ranks") as (logdir, started):
        decoder = start_sim(1, logdir, model="tiny", extra=["--profile", "tiny-cpu"], name="decoder")
        started.append(decoder.process)
        prefiller = start_sim(1, logdir, model="tiny", extra=["--profile", "tiny-cpu", "--data-parallel-size", "2"],
                              name="prefiller")
        started.append(prefiller.process)
        sidecar, _ = start_sidecar(logdir, started, decoder.addresses[0], "sidecar")
        server = prefiller.addresses[0]
        endpoints = tmp_path / "endpoints.yaml"
        endpoints.write_text(yaml.safe_dump([{"address": sidecar, "labels": {ROLE: "decode"}},
                                             {"address": server, "labels": {ROLE: "prefill"}}]))
        config = tmp_path / "picker.yaml"
        config.write_text(yaml.safe_dump({"scheduling": PD}))
        picker = start_picker(logdir, endpoints_file=endpoints, extra=["--config-file", str(config),
                                                                       "--metrics-slow-interval", "200ms"])
        started.append(picker.process)
        wait_until(lambda: {f"{server}#0", f"{server}#1"} <= set(targets(picker)), 20, "the prefill server's ranks",
                   picker.process.proc)
        envoy = start_envoy(logdir, picker, [sidecar, server], disaggregation=True)
        started.append(envoy.process)

        shared = prompt(600)
        send(envoy.url, shared + " " + prompt(300))  # long and cached nowhere: prefilled on one rank of the server
        first = rank_counters(server)
        assert sum(r["steered"] for r in first) == 1  # the prefill leg named the rank (vLLM did not balance it)
        home = next(r["rank"] for r in first if r["steered"])
        send(envoy.url, shared + " " + prompt(300))  # its beginning is cached on that rank: prefilled there again
        second = rank_counters(server)
        assert second[home]["steered"] == 2 and second[1 - home]["requests"] == 0
        assert second[home]["prefix_cache_hits"] > first[home]["prefix_cache_hits"]
        assert counter(f"{HOST}:{picker.metrics_port}", "llm_d_epp_disagg_decision_total",
                       decision_type="prefill-decode") == 2
