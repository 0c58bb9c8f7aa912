"""Through Envoy onto `picker sim` pods (which count prompt tokens as vLLM does): the picker learns the traffic's
characters per token from the pods' counters and shows it."""

from __future__ import annotations

import json
import random
import urllib.request

from picker_lab.supervisor import HOST, process_scope, start_envoy, start_picker, start_sim, wait_until

WORDS = ["alpha", "bo", "cider", "delta", "ex", "fox", "gamma", "hi", "iota", "jam"]


def learned(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("picker_prefix_chars_per_token "):
                return float(line.split()[1])
    return float("nan")


def test_chars_per_token_is_learned_from_the_pods_prompt_token_counters() -> None:
    rng = random.Random(3)
    with process_scope("chars-per-token") as (logdir, started):
        sim = start_sim(2, logdir, model="tiny", extra=["--profile", "tiny-cpu"])
        started.append(sim.process)
        picker = start_picker(logdir, endpoints=sim.addresses,
                              extra=["--metrics-fast-interval", "50ms", "--metrics-slow-interval", "100ms"])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, sim.addresses)
        started.append(envoy.process)
        # prefixCache.charsPerToken until the pods have counted (the gauge is set once a second)
        wait_until(lambda: learned(picker.metrics_port) == 4.0, 15, "the configured value shown", picker.process.proc)

        def send() -> None:
            prompt = " ".join(rng.choice(WORDS) for _ in range(120))
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
            request = urllib.request.Request(envoy.url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200

        def moved() -> bool:
            for _ in range(10):
                send()
            return learned(picker.metrics_port) != 4.0

        wait_until(moved, 60, "the picker learns characters per token", picker.process.proc)
        value = learned(picker.metrics_port)
        print(f"learned {value:.2f} characters per token")
        assert 1.0 < value < 4.0  # short words: fewer characters per token than English
