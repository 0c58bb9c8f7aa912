"""Pods that speak SGLang's metric dialect, through real Envoy: the picker reads their queue, running count, KV use
and model from SGLang's names (told from the page itself) and routes on them as on vLLM's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from picker.supervisor import (
    process_scope,
    set_echo_metrics,
    start_backends,
    start_envoy,
    start_picker,
    wait_until,
)


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
