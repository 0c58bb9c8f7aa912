"""Pods that speak another engine's metric dialect, through real Envoy: the picker reads their queue, running count,
KV use and model from SGLang's or TensorRT-LLM's names (told from the page itself) and routes on them as on vLLM's.
Echo pods show a page as set; `picker sim --engine` pods show what their simulated engine does under load."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.endpoints.metrics import parse_metrics
from picker_lab.supervisor import (
    Picker,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_envoy,
    start_picker,
    start_sim,
    wait_until,
)

# tiny-cpu pods that run two requests at once: the rest of a burst waits
SIM_FLAGS = ["--profile", "tiny-cpu", "--max-num-seqs", "2"]


def served_by(url: str, model: str, prompt: str) -> tuple[int, str]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": model, "prompt": prompt})
                                     .encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, str(json.loads(response.read())["served_by"])
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]["code"]


def test_sglang_pods_are_routed_on_their_own_metric_names() -> None:
    with process_scope("sglang-dialect") as (logdir, started):
        pods = start_backends(2, logdir)
        started.append(pods.process)
        busy, free = pods.addresses
        set_echo_metrics(busy, engine="sglang", models=["qwen"], waiting=12, running=8, kv=0.95)
        set_echo_metrics(free, engine="sglang", models=["qwen"], waiting=0, running=1, kv=0.1)
        picker = start_picker(logdir, endpoints=pods.addresses)
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pods.addresses)
        started.append(envoy.process)
        wait_until(lambda: served_by(envoy.url, "nope", "x")[0] == 404, 10, "the pods' model read from SGLang's page",
                   picker.process.proc)
        assert {served_by(envoy.url, "qwen", f"question {i} " * 10) for i in range(8)} == {(200, free)}
        assert served_by(envoy.url, "llama", "who serves me") == (404, "model_not_found")
        # asked once for vLLM's series by name (SGLang's page has none of them), read whole from then on
        for address in pods.addresses:
            with urllib.request.urlopen(f"http://{address}/test/count", timeout=5) as response:
                count = json.loads(response.read())
            assert count["filtered_metrics_pages"] == 1 and count["metrics_pages"] >= 1


def sim_served_by(url: str, model: str, prompt: str) -> tuple[int, str]:
    """Status and the sim pod that answered (its `x-sim-pod` header), or the picker's error code."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status, response.headers["x-sim-pod"]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]["code"]


@contextmanager
def burst(address: str, model: str, lengths: list[int]) -> Iterator[None]:
    """Completions sent straight to one pod, in order, past Envoy and the picker (which learn of them only from the
    pod's metrics); they are left running and closed (aborted) on exit."""
    host, port = address.rsplit(":", 1)
    connections = []
    try:
        for i, max_tokens in enumerate(lengths):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": f"load {i}",
                                                                 "max_tokens": max_tokens}),
                         {"content-type": "application/json"})
            connections.append(conn)
        yield
    finally:
        for conn in connections:
            conn.close()


def picker_view(picker: Picker) -> dict[str, picker_pb2.EndpointInfo]:
    """What the picker read of each pod (its picker.v1 ListEndpoints)."""
    with picker.channel() as channel:
        listing = picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
    return {e.address: e for e in listing.endpoints}


def page(address: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
        return response.read().decode()


def test_sglang_sim_pods_are_read_and_routed_on_what_their_engines_do() -> None:
    """Two `picker sim --engine sglang` pods: a burst on one queues (two run, three wait); the picker reads that from
    SGLang's names, with the pod's cache geometry and model, and sends new requests to the other."""
    with process_scope("sglang-sim") as (logdir, started):
        pods = start_sim(2, logdir, model="qwen-sim", time_scale=0.5, extra=[*SIM_FLAGS, "--engine", "sglang"])
        started.append(pods.process)
        busy, free = pods.addresses
        picker = start_picker(logdir, endpoints=pods.addresses)
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pods.addresses)
        started.append(envoy.process)
        with burst(busy, "qwen-sim", [3000] * 5):
            def queued() -> bool:
                seen = picker_view(picker)[busy]
                return (seen.waiting, seen.running) == (3.0, 2.0) and seen.kv_cache_usage > 0

            wait_until(queued, 15, "the busy pod's queue read from SGLang's page", picker.process.proc)
            seen = picker_view(picker)
            assert (seen[busy].block_size, seen[busy].num_gpu_blocks) == (128, 8191)
            assert (seen[free].waiting, seen[free].running, seen[free].kv_cache_usage) == (0.0, 0.0, 0.0)
            assert {sim_served_by(envoy.url, "qwen-sim", f"question {i} " * 10) for i in range(6)} == {(200, "sim-1")}
            assert sim_served_by(envoy.url, "llama", "who serves me") == (404, "model_not_found")


def test_trtllm_sim_pods_are_read_from_prometheus_metrics_and_routed() -> None:
    """Two `picker sim --engine trtllm` pods scraped where trtllm-serve serves Prometheus (/prometheus/metrics).
    Its gauges move when a request finishes: a short request among a burst finishes while one long runs and three
    wait; the picker's view is then the pod's page, value for value, and new requests go to the other pod."""
    with process_scope("trtllm-sim") as (logdir, started):
        pods = start_sim(2, logdir, model="llama-sim", time_scale=0.5, extra=[*SIM_FLAGS, "--engine", "trtllm"])
        started.append(pods.process)
        busy, free = pods.addresses
        picker = start_picker(logdir, endpoints=pods.addresses,
                              extra=["--model-server-metrics-path", "/prometheus/metrics"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pods.addresses)
        started.append(envoy.process)
        wait_until(lambda: sim_served_by(envoy.url, "nope", "x")[0] == 404, 10,
                   "the pods' model read from trtllm_model_config_info", picker.process.proc)
        with burst(busy, "llama-sim", [40, 3000, 3000, 3000, 3000]):
            def read_as_served() -> bool:
                own = parse_metrics(page(busy, "/prometheus/metrics"))
                seen = picker_view(picker)[busy]
                return own.waiting > 0 and own.running > 0 and (
                    seen.waiting, seen.running, seen.kv_cache_usage, seen.block_size, seen.num_gpu_blocks) == (
                    own.waiting, own.running, own.kv_usage, own.block_size, own.num_gpu_blocks)

            wait_until(read_as_served, 15, "the busy pod's trtllm gauges in the picker", picker.process.proc)
            seen = picker_view(picker)
            assert (seen[busy].block_size, seen[busy].num_gpu_blocks) == (128, 8191)
            assert (seen[free].waiting, seen[free].running) == (0.0, 0.0)  # no request finished there yet
            assert {sim_served_by(envoy.url, "llama-sim", f"question {i} " * 10) for i in range(6)} == {(200, "sim-1")}
            assert sim_served_by(envoy.url, "llama", "who serves me") == (404, "model_not_found")
