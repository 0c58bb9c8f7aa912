"""`picker demo`: Envoy + a simulated vLLM fleet + the picker, all children of this process on free loopback
ports; sends sample requests and shows where each went and why. Ctrl-C (or --once) stops everything."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

import picker.api  # noqa: F401 - says how to build the stubs when they are missing
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.explain import format_explain
from picker.supervisor import (
    Managed,
    Picker,
    free_port,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
    start_sim,
    start_valkey,
)

SYSTEM = ("You are a meticulous assistant for the ACME inference platform. Answer in short, precise sentences, "
          "cite the runbook section you rely on, and never invent configuration flags. ") * 6


@dataclass(slots=True)
class Sample:
    title: str
    path: str
    body: dict[str, Any] | bytes | None
    method: str = "POST"


def samples(model: str) -> list[Sample]:
    def chat(question: str, **extra: Any) -> dict[str, Any]:
        return {"model": model, "max_tokens": 16, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}

    return [
        Sample("chat, shared system prompt (cold)", "/v1/chat/completions", chat("How do I drain a node?")),
        Sample("chat, same system prompt", "/v1/chat/completions", chat("How do I roll back a release?")),
        Sample("chat, same system prompt, streamed", "/v1/chat/completions",
               chat("Which metrics matter for autoscaling?", stream=True)),
        Sample("completion, unrelated prompt", "/v1/completions",
               {"model": model, "prompt": "The three laws of thermodynamics are", "max_tokens": 16}),
        Sample("header-only request", "/v1/models", None, method="GET"),
        Sample("bad request: not JSON", "/v1/chat/completions", b"{oops"),
        Sample("bad request: unknown path", "/v1/fine_tuning/jobs", {"model": model}),
    ]


def _send(url: str, sample: Sample) -> tuple[int, str, str]:
    data = sample.body if isinstance(sample.body, bytes) or sample.body is None else json.dumps(sample.body).encode()
    request = urllib.request.Request(url + sample.path, data=data, method=sample.method,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("x-sim-pod", ""), response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, "", err.read().decode(errors="replace")


def _explain(channel: grpc.Channel, sample: Sample) -> tuple[str, list[str]]:
    """Explain text, and the endpoints tied for the best score (any of them may be picked)."""
    if sample.body is None:
        return "header-only: least-loaded ready endpoint", []
    body = sample.body if isinstance(sample.body, bytes) else json.dumps(sample.body).encode()
    stub = picker_pb2_grpc.PickerStub(channel)
    response = stub.Explain(picker_pb2.ExplainRequest(path=sample.path, body=body), timeout=5)
    best = max((c.total for c in response.candidates), default=0.0)
    return format_explain(response), [c.address for c in response.candidates if c.total >= best - 1e-9]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=3, help="simulated vLLM pods (default 3)")
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--backend", choices=["sim", "echo"], default="sim",
                        help="sim: simulated vLLM (default); echo: tiny servers that echo what they got")
    parser.add_argument("--mode", choices=["buffered", "full-duplex"], default="buffered")
    parser.add_argument("--replicas", type=int, default=1,
                        help="picker replicas behind Envoy, sharing the prefix index through a local Valkey (default 1)")
    parser.add_argument("--once", action="store_true", help="exit after the sample requests")


def _start_pickers(replicas: int, pool: list[str], logdir: Path, started: list[Managed]) -> list[Picker]:
    """One picker, or several on their own loopback addresses (same ports, as pods behind a Service) sharing
    the prefix index through a Valkey started for the demo."""
    if replicas <= 1:
        picker = start_picker(logdir, endpoints=pool)
        started.append(picker.process)
        return [picker]
    valkey = start_valkey(logdir)
    started.append(valkey.process)
    print(f"  valkey: {valkey.url} (the prefix index shared by {replicas} picker replicas)")
    grpc_port, health_port = free_port(), free_port()
    pickers = []
    for i in range(replicas):
        picker = start_picker(logdir, endpoints=pool, name=f"picker-{i}", host=f"127.0.0.{10 + i}",
                              grpc_port=grpc_port, health_port=health_port,
                              extra=["--index-backend", "redis", "--redis-url", valkey.url])
        started.append(picker.process)
        pickers.append(picker)
    return pickers


def run(args: argparse.Namespace) -> int:
    with process_scope("demo") as (logdir, started):
        print(f"picker demo: logs in {logdir}")
        if args.backend == "sim":
            fleet = start_sim(args.pods, logdir, model=args.model, time_scale=10.0)
            started.append(fleet.process)
        else:
            fleet = start_backends(args.pods, logdir)
            started.append(fleet.process)
        pickers = _start_pickers(args.replicas, fleet.addresses, logdir, started)
        picker = pickers[0]
        envoy = start_envoy(logdir, pickers, fleet.addresses, mode=args.mode)
        started.append(envoy.process)
        print(f"  fleet:  {', '.join(fleet.addresses)}")
        for p in pickers:
            print(f"  picker: {p.host}:{p.grpc_port} (metrics http://{p.host}:{p.metrics_port}/metrics)")
        print(f"  envoy:  {envoy.url} ({args.mode} body mode)\n")
        names = {f"sim-{i}": address for i, address in enumerate(fleet.addresses)}  # x-sim-pod → address
        with grpc.insecure_channel(f"{picker.host}:{picker.grpc_port}") as channel:
            for i, sample in enumerate(samples(args.model), 1):
                why, best = _explain(channel, sample)
                status, pod, text = _send(envoy.url, sample)
                print(f"[{i}] {sample.method} {sample.path}  {sample.title}")
                print("    " + why.replace("\n", "\n    "))
                if status == 200:
                    served = names.get(pod, pod) or (json.loads(text).get("served_by", "?")
                                                     if text.startswith("{") else "?")
                    tie = " (tied for best score: random tie-break)" if len(best) > 1 and served in best else ""
                    print(f"    -> 200 served by {served}{tie}\n")
                else:
                    print(f"    -> {status} {text[:200]}\n")
                time.sleep(0.2)
        if args.once:
            return 0
        print(f"Envoy is up at {envoy.url}; try:\n  curl -s {envoy.url}/v1/chat/completions -H 'content-type: "
              f"application/json' -d '{{\"model\": \"{args.model}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"hi\"}}]}}'\n  picker explain --target {picker.host}:{picker.grpc_port} --endpoints\n"
              "Ctrl-C stops everything.")
        # Ctrl-C and SIGTERM both stop everything (also when started in the background, where SIGINT is ignored).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0
