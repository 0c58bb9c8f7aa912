"""`picker explain`: ask a running picker where a request would go and why (scores per scorer), or list
the pool it sees. Nothing is routed and no state changes. Exit status: 0 a pick, 3 the picker would refuse the
request (the reason is printed), 1 the picker could not be asked, 2 a usage error."""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from pathlib import Path

import grpc

import picker.api  # noqa: F401 - says how to build the stubs when they are missing
from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.core.argtypes import host_port
from picker.serving.tls import TlsError, client_credentials, presented_certificate, read_pair

REFUSED = 3  # exit status when the picker would refuse the request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--target", type=host_port, default="127.0.0.1:9002", help="picker gRPC address (default 127.0.0.1:9002)")
    a("--path", default="/v1/chat/completions", help="request path the body is for")
    a("--body", help="request body as JSON text; '@file' reads a file, '-' reads stdin")
    a("--header", action="append", default=[], metavar="NAME=VALUE", help="extra request header (repeatable)")
    a("--endpoints", action="store_true", help="list the pool instead of explaining a request")
    a("--json", action="store_true", help="machine-readable output")
    a("--plaintext", action="store_true",
      help="talk plaintext gRPC (a picker run with --secure-serving=false); default: TLS, as the picker serves")
    a("--ca", metavar="FILE", help="verify the picker's certificate against this CA (default: accept the "
      "certificate it presents, as gateways do with its self-signed one)")
    a("--client-cert", metavar="DIR", help="tls.crt and tls.key to present (a picker run with --client-ca)")
    a("--server-name", default="", help="name to check the certificate for (default: the --target host)")


def _channel(args: argparse.Namespace) -> grpc.aio.Channel:
    if args.plaintext:
        return grpc.aio.insecure_channel(args.target)
    ca = Path(args.ca).read_bytes() if args.ca else None
    client = read_pair(Path(args.client_cert), "--client-cert") if args.client_cert else None
    credentials, options = client_credentials(args.target, ca=ca, client=client, server_name=args.server_name)
    return grpc.aio.secure_channel(args.target, credentials, options=options)


def _read_body(spec: str) -> bytes:
    if spec == "-":
        return sys.stdin.buffer.read()
    if spec.startswith("@"):
        return Path(spec[1:]).read_bytes()
    return spec.encode()


def format_explain(response: picker_pb2.ExplainResponse) -> str:
    if response.error_status:
        return f"refused: {response.error_status} {response.error_code}: {response.error_message}"
    lines = [f"pick: {response.ranked[0] if response.ranked else '-'}   profile: {response.profile}   "
             f"priority: {response.priority}   prefix blocks matched: "
             f"{response.prefix_matched_blocks}/{response.prefix_blocks}"]
    if response.data_parallel_rank >= 0:
        lines.append(f"sent to: {response.destination} with x-data-parallel-rank: {response.data_parallel_rank}")
    if response.profile_reason:
        lines.append(f"why {response.profile}: {response.profile_reason}")
    if response.media:
        lines.append("media: " + ", ".join(f"{m.kind} {m.digest} ({m.tokens} tokens, by {m.source})"
                                           for m in response.media))
    if response.admission:
        lines.append("admission: " + "  ".join(f"{k}={v:g}" for k, v in sorted(response.admission.items())))
    names = sorted({name for c in response.candidates for name in c.scores})
    labels = [n.removesuffix("-scorer") for n in names]
    widths = [max(6, len(label)) for label in labels]
    lines.append("  ".join([f"{'endpoint':<22}", *(f"{n:>{w}}" for n, w in zip(labels, widths, strict=True)),
                            f"{'total':>8}", "note"]))
    if response.weights:  # what `total` sums: weight x score
        lines.append("  ".join([f"{'  x weight':<22}", *(f"{_weight(response.weights.get(n)):>{w}}"
                                                         for n, w in zip(names, widths, strict=True))]).rstrip())
    for c in sorted(response.candidates, key=lambda c: -c.total):
        cells = [f"{c.address:<22}",
                 *(f"{c.scores.get(n, float('nan')):>{w}.3f}" for n, w in zip(names, widths, strict=True)),
                 f"{c.total:>8.3f}", f"filtered by {c.filtered_by}" if c.filtered_by else ""]
        lines.append("  ".join(cells).rstrip())
        if c.details:
            lines.append(f"{'':<22}  " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(c.details.items())))
    return "\n".join(lines)


def _weight(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _age(endpoint: picker_pb2.EndpointInfo) -> str:
    return "never" if endpoint.metrics_age_seconds < 0 else f"{endpoint.metrics_age_seconds:.1f}s"


async def _call(args: argparse.Namespace) -> tuple[str, bool]:
    """What to print, and whether the picker refused the request (the exit status says so)."""
    async with _channel(args) as channel:
        stub = picker_pb2_grpc.PickerStub(channel)
        if args.endpoints:
            listing = await stub.ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
            if args.json:
                return json.dumps([{"address": e.address, "healthy": e.healthy, "state": e.state,
                                    "metrics_age_seconds": e.metrics_age_seconds, "waiting": e.waiting,
                                    "running": e.running, "kv_cache_usage": e.kv_cache_usage,
                                    "in_flight": e.in_flight} for e in listing.endpoints], indent=2), False
            return "\n".join(f"{e.address:<22} {e.state:<9} waiting={e.waiting:g} running={e.running:g} "
                             f"kv={e.kv_cache_usage:.2f} in_flight={e.in_flight} metrics_age={_age(e)}"
                             for e in listing.endpoints) or "(no endpoints)", False
        headers = dict(h.split("=", 1) for h in args.header)
        request = picker_pb2.ExplainRequest(path=args.path, body=_read_body(args.body or "-"), headers=headers)
        response = await stub.Explain(request, timeout=5)
        refused = bool(response.error_status)
        if args.json:
            return json.dumps({"ranked": list(response.ranked), "destination": response.destination or None,
                               "data_parallel_rank": response.data_parallel_rank if response.ranked else None,
                               "profile": response.profile,
                               "profile_reason": response.profile_reason, "weights": dict(response.weights),
                               "error": response.error_code or None,
                               "candidates": [{"address": c.address, "scores": dict(c.scores),
                                               "details": dict(c.details), "total": c.total,
                                               "filtered_by": c.filtered_by or None}
                                              for c in response.candidates],
                               "media": [{"kind": m.kind, "digest": m.digest, "tokens": m.tokens, "source": m.source}
                                         for m in response.media],
                               "admission": dict(response.admission)}, indent=2), refused
        return format_explain(response), refused


def _speaks_tls(target: str) -> bool:
    """Whether a TLS server answers at `target`: why a plaintext call was refused."""
    host, _, port = target.rpartition(":")
    try:
        presented_certificate(host.strip("[]"), int(port), timeout=2.0)
    except (OSError, ValueError):
        return False
    return True


def run(args: argparse.Namespace) -> int:
    if not args.endpoints and args.body is None:
        print("picker explain: --body is required (or --endpoints)", file=sys.stderr)
        return 2
    try:
        text, refused = asyncio.run(_call(args))
        print(text)
    except grpc.aio.AioRpcError as err:
        hint = ""
        if args.plaintext and err.code() is grpc.StatusCode.UNAVAILABLE and _speaks_tls(args.target):
            hint = ("\n  it serves TLS (the picker's default, --secure-serving): drop --plaintext (add --ca FILE to "
                    "verify its certificate)")
        print(f"picker explain: {args.target}: {err.code().name}: {err.details()}{hint}", file=sys.stderr)
        return 1
    except ssl.SSLError as exc:
        print(f"picker explain: {args.target} does not speak TLS ({exc.reason or exc}): a picker run with "
              "--secure-serving=false needs --plaintext", file=sys.stderr)
        return 1
    except (OSError, TlsError) as exc:
        print(f"picker explain: {args.target}: {exc}", file=sys.stderr)
        return 1
    return REFUSED if refused else 0
