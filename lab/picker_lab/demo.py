"""`picker demo`: Envoy + a simulated vLLM fleet + the picker, all children of this process on free loopback
ports; sends sample requests and shows where each went and why. Ctrl-C (or --once) stops everything."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

import picker.api  # noqa: F401 - says how to build the stubs when they are missing
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.core.argtypes import whole_number
from picker.tools.explain import format_explain
from picker_lab.demo_burst import (
    ADMISSION,
    BURST,
    POD_SEQUENCES,
    SERVED_BY,
    describe,
    metric,
    run_burst,
    send,
)
from picker_lab.sim.profiles import LLAMA3_8B_H100
from picker_lab.supervisor import (
    Managed,
    Picker,
    ProcessExited,
    free_ports,
    process_scope,
    set_echo_metrics,
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
    expect: int = 200  # any other status means the demo failed (its logs are kept)


def _chat(model: str, question: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}


def samples(model: str) -> list[Sample]:
    def chat(question: str, **extra: Any) -> dict[str, Any]:
        return _chat(model, question, **extra)

    return [
        Sample("chat, shared system prompt (cold)", "/v1/chat/completions", chat("How do I drain a node?")),
        Sample("chat, same system prompt", "/v1/chat/completions", chat("How do I roll back a release?")),
        Sample("chat, same system prompt, streamed", "/v1/chat/completions",
               chat("Which metrics matter for autoscaling?", stream=True)),
        Sample("completion, unrelated prompt", "/v1/completions",
               {"model": model, "prompt": "The three laws of thermodynamics are", "max_tokens": 16}),
        Sample("header-only request", "/version", None, method="GET"),
        Sample("the pool's models (the picker answers: the union of what its pods serve)", "/v1/models", None,
               method="GET"),
        Sample("bad request: not JSON", "/v1/chat/completions", b"{oops", expect=400),
        Sample("bad request: unknown path", "/v1/fine_tuning/jobs", {"model": model}, expect=404),
    ]


def _send(url: str, sample: Sample) -> tuple[int, str, str]:
    """Status, the address of the pod that answered (the demo's Envoy says: "" when the picker answered itself)
    and the body."""
    answer = send(url + sample.path, sample.body, method=sample.method)
    return answer.status, answer.pod, answer.body


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to about `limit` characters at a word's end, with an ellipsis when anything was cut."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut.rstrip(",;:") + " …"


@dataclass(slots=True)
class Explained:
    """What Explain said before the request was sent: its text, its first pick and the endpoints tied with it."""

    text: str
    first: str = ""
    tied: tuple[str, ...] = ()


def _explain(channel: grpc.Channel, sample: Sample) -> Explained:
    """Explain runs the request's own ranking, but a tie for the best score is broken by a draw from the
    picker's one (seeded) RNG: Explain takes a draw and the routed request the next one, so on a tie the two
    may name different pods even with `--seed 7`. The headline therefore names every tied endpoint, not one."""
    if sample.body is None:
        if sample.path == "/v1/models":
            return Explained("not routed: the picker lists the models the pool's pods report")
        return Explained("header-only: least-loaded ready endpoint")
    body = sample.body if isinstance(sample.body, bytes) else json.dumps(sample.body).encode()
    stub = picker_pb2_grpc.PickerStub(channel)
    response = stub.Explain(picker_pb2.ExplainRequest(path=sample.path, body=body), timeout=5)
    text = format_explain(response)
    if not response.ranked:
        return Explained(text)
    first = response.ranked[0]
    eligible = [c for c in response.candidates if not c.filtered_by]
    best = max((c.total for c in eligible), default=0.0)
    tied = tuple(sorted(c.address for c in eligible if c.total >= best - 1e-9))
    if len(tied) > 1:
        text = text.replace(f"pick: {first}", f"pick: tie of {len(tied)} at {best:.3f} ({', '.join(tied)})", 1)
    return Explained(text, first, tied if len(tied) > 1 else (first,))


def _model_ids(text: str) -> str:
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return ", ".join(str(m["id"]) for m in json.loads(text)["data"])
    return text[:200]


def _served_note(explained: Explained, served: str) -> str:
    """How the pod that served the request relates to Explain's pick, said plainly when they differ."""
    if served == "?":
        return " (the backend does not say which pod it is)"
    if len(explained.tied) > 1 and served in explained.tied:
        return f" (one of the {len(explained.tied)} tied: the request drew its own random tie-break)"
    if explained.first and served != explained.first:
        return (f" (not Explain's pick {explained.first}: the pool's metrics or load changed between the "
                "Explain call and the request)")
    return ""


def _decisions(pickers: list[Picker]) -> list[float]:
    """Each replica's count of requests it routed or refused (only asked for when there are several)."""
    return [metric(p, "llm_d_epp_request_total") for p in pickers] if len(pickers) > 1 else []


def _decided_by(pickers: list[Picker], before: list[float]) -> str:
    """", decided by replica 127.0.0.11" when several replicas share the work: the one whose count moved."""
    if not before:
        return ""
    moved = [p.host for p, was, now in zip(pickers, before, _decisions(pickers), strict=True) if now > was]
    return f", decided by replica {', '.join(moved)}" if moved else ""


def picker_command() -> str:
    """The `picker` script of the running interpreter, so the printed commands work from any shell."""
    script = Path(sys.executable).parent / "picker"
    return shlex.quote(str(script)) if script.exists() else f"{shlex.quote(sys.executable)} -m picker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=whole_number(1, 64), default=3, help="simulated vLLM pods, 1 to 64 (default 3)")
    parser.add_argument("--model", default=LLAMA3_8B_H100.model,
                        help="model name the simulated pods serve and the samples ask for (default %(default)s)")
    parser.add_argument("--backend", choices=["sim", "echo"], default="sim",
                        help="sim: simulated vLLM; echo: tiny servers that echo what they got (default %(default)s)")
    parser.add_argument("--mode", choices=["buffered", "full-duplex"], default="buffered",
                        help="Envoy's ext_proc body mode: buffer the whole body, or stream it (default %(default)s)")
    parser.add_argument("--replicas", type=whole_number(1, 16), default=1,
                        help="picker replicas behind Envoy, sharing the prefix index through a local Valkey, 1 to 16 "
                        "(default 1)")
    parser.add_argument("--once", action="store_true", help="exit after the sample requests")
    parser.add_argument("--tls", action="store_true",
                        help="Envoy -> picker over mTLS: a throwaway CA signs the picker's certificate and Envoy's "
                        "client certificate, each side verifies the other (default: plaintext, as a sidecar)")


def _start_pickers(replicas: int, pool: list[str], logdir: Path, started: list[Managed],
                   tls: str = "plaintext") -> list[Picker]:
    """One picker, or several on their own loopback addresses (same ports, as pods behind a Service) sharing
    the prefix index through a Valkey started for the demo; with the demo's admission (demo_burst.ADMISSION)."""
    admission = ["--config-text", json.dumps(ADMISSION)]
    if replicas <= 1:
        picker = start_picker(logdir, endpoints=pool, tls=tls, extra=admission)
        started.append(picker.process)
        return [picker]
    valkey = start_valkey(logdir)
    started.append(valkey.process)
    print(f"  valkey: {valkey.url} (the prefix index shared by {replicas} picker replicas)")
    grpc_port, health_port = free_ports(2)
    key = logdir / "index-key"  # the replicas' shared secret: what they write to Valkey is keyed with it
    key.write_text(secrets.token_hex(32))
    pickers = []
    for i in range(replicas):
        picker = start_picker(logdir, endpoints=pool, name=f"picker-{i}", host=f"127.0.0.{10 + i}",
                              grpc_port=grpc_port, health_port=health_port, tls=tls,
                              extra=["--index-backend", "redis", "--redis-url", valkey.url,
                                     "--index-hash-key-file", str(key), *admission])
        started.append(picker.process)
        pickers.append(picker)
    return pickers


class _Failed(Exception):
    """The demo ran but did not do what it shows (a sample got another status): its logs are kept."""


def run(args: argparse.Namespace) -> int:
    """Run the demo in a temporary log folder, removed on exit; kept (and named) only when the demo failed. A child
    that dies is reported by name, with its last log lines and why, never as a traceback."""
    logdir: Path | None = None
    try:
        with process_scope("demo") as (logdir, started):
            if _run(args, logdir, started) != 0:
                raise _Failed
        return 0
    except KeyboardInterrupt:  # Ctrl-C while starting up: stopped, not failed
        if logdir is not None:
            shutil.rmtree(logdir, ignore_errors=True)
        return 130
    except ProcessExited as exited:
        print(f"picker demo: {exited.describe()}", file=sys.stderr)
    except TimeoutError as exc:
        print(f"picker demo: {exc} (the machine may be overloaded)", file=sys.stderr)
    except _Failed:
        pass
    print(f"picker demo failed: logs kept in {logdir}", file=sys.stderr)
    return 1


def _run(args: argparse.Namespace, logdir: Path, started: list[Managed]) -> int:
    print(f"picker demo: logs in {logdir} (removed on exit unless the demo fails)")
    if args.backend == "sim":
        fleet = start_sim(args.pods, logdir, model=args.model, time_scale=10.0,
                          extra=["--max-num-seqs", str(POD_SEQUENCES)])
        started.append(fleet.process)
    else:
        fleet = start_backends(args.pods, logdir)
        started.append(fleet.process)
        for address in fleet.addresses:
            set_echo_metrics(address, models=[args.model])  # they report serving the model the samples ask for
    pickers = _start_pickers(args.replicas, fleet.addresses, logdir, started, "mtls" if args.tls else "plaintext")
    picker = pickers[0]
    envoy = start_envoy(logdir, pickers, fleet.addresses, mode=args.mode, served_by=SERVED_BY)
    started.append(envoy.process)
    print(f"  fleet:  {', '.join(fleet.addresses)}")
    for p in pickers:
        security = f"mTLS, certificates in {p.pki}" if p.pki else "plaintext"
        print(f"  picker: {p.host}:{p.grpc_port} ({security}; metrics http://{p.host}:{p.metrics_port}/metrics)")
    print(f"  envoy:  {envoy.url} ({args.mode} body mode)\n")
    unexpected = 0
    held_by = ""  # the pod the shared system prompt went to: the burst's cache-affine choice
    with picker.channel() as channel:
        for i, sample in enumerate(samples(args.model), 1):
            explained = _explain(channel, sample)  # before the request: routing it changes the index
            decided = _decisions(pickers)
            status, pod, text = _send(envoy.url, sample)
            print(f"[{i}] {sample.method} {sample.path}  {sample.title}")
            print("    " + explained.text.replace("\n", "\n    "))
            by = _decided_by(pickers, decided)
            if status == 200 and not pod:
                print(f"    -> 200 answered by the picker{by}: {_model_ids(text)}\n")
            elif status == 200:
                held_by = held_by or pod
                print(f"    -> 200 served by {pod}{_served_note(explained, pod)}{by}\n")
            else:
                print(f"    -> {status} {clip(text)}{by}\n")
            if status != sample.expect:
                unexpected += 1
                print(f"    !! expected {sample.expect}\n")
            time.sleep(0.2)
    if args.backend == "sim":
        print(f"[{len(samples(args.model)) + 1}] burst: {BURST} chats at once sharing the system prompt, then a "
              "sheddable one")
        burst = run_burst(envoy.url + "/v1/chat/completions", pickers,
                          lambda question: _chat(args.model, question, max_tokens=256))
        print("\n".join(f"    {line}" for line in describe(burst, held_by)) + "\n")
        unexpected += sum(1 for a in burst.answers if a.status != 200)
    else:
        print(f"[{len(samples(args.model)) + 1}] burst: skipped with --backend echo (its pods answer at once: there is "
              "no load to spread or queue)\n")
    if unexpected:
        print(f"picker demo: {unexpected} sample(s) did not get the status they expect", file=sys.stderr)
        return 1
    if args.once:
        return 0
    # Ctrl-C and SIGTERM both stop everything (also when started in the background, where SIGINT is ignored);
    # installed before the commands below are printed, so whoever reads them may stop the demo at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    body = {"model": args.model, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
    quoted = shlex.quote(json.dumps(body))
    target = f"{picker.host}:{picker.grpc_port}"
    if picker.pki is not None:
        target += f" --ca {picker.pki / 'ca.crt'} --client-cert {picker.pki / 'client'} --server-name localhost"
    else:
        target += " --plaintext"
    print(f"Envoy is up at {envoy.url}; try:\n"
          f"  curl -si {envoy.url}/v1/chat/completions -H 'content-type: application/json' -d {quoted}\n"
          f"  {picker_command()} explain --target {target} --body {quoted}\n"
          f"  {picker_command()} explain --target {target} --endpoints\n"
          "Ctrl-C stops everything.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)
    return 0
