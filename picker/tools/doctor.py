"""`picker doctor`: ask Envoy's admin interface whether requests reach the picker, and if they fail open, why.

A picker Envoy cannot talk to is silent by design: with `failure_mode_allow` every request still gets an answer,
routed round-robin by the fail-open route, and the picker never sees the streams that failed. Envoy knows: its
ext_proc filter counts the streams it let through unprocessed, and its `picker` cluster counts refused
connections, failed TLS handshakes and connections the picker closed. This command reads those counters and the
cluster's transport (TLS or plaintext) and names the cause in one line each; it also names header changes of the
picker that the filter's mutation_rules refused. Exit status: 0 requests reach the
picker, 1 something is wrong (said on stdout), 2 Envoy's admin interface cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PICKER_CLUSTER = "picker"  # the ext_proc cluster of the Envoy configs `picker envoy-config` writes


@dataclass(slots=True)
class EnvoyView:
    """What Envoy's admin interface says about the picker: counters, the cluster's hosts and its transport."""

    stats: dict[str, int]
    hosts: dict[str, str] = field(default_factory=dict)  # picker address -> its health flags
    tls: bool | None = None  # Envoy speaks TLS to the picker (None: no such cluster in its config)

    def ext_proc(self, name: str) -> int:
        """An ext_proc counter summed over every HTTP connection manager (`http.<prefix>.ext_proc.<name>`)."""
        suffix = f".ext_proc.{name}"
        return sum(v for k, v in self.stats.items() if k.startswith("http.") and k.endswith(suffix))

    def cluster(self, name: str) -> int:
        return self.stats.get(f"cluster.{PICKER_CLUSTER}.{name}", 0)


def read(admin: str, timeout: float = 5.0) -> EnvoyView:
    """Envoy's counters, the picker cluster's hosts and its transport socket; OSError when the admin is unreachable."""
    stats: dict[str, int] = {}
    for line in _get(admin, "/stats", timeout).splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            stats[name] = int(value)
    hosts: dict[str, str] = {}
    for line in _get(admin, "/clusters", timeout).splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == PICKER_CLUSTER and parts[2] == "health_flags":
            hosts[parts[1]] = parts[3]
    dump = json.loads(_get(admin, "/config_dump?resource=static_clusters", timeout))
    return EnvoyView(stats, hosts, _picker_tls(dump))


def _get(admin: str, path: str, timeout: float) -> str:
    with urllib.request.urlopen(admin.rstrip("/") + path, timeout=timeout) as response:
        return str(response.read().decode())


def _picker_tls(dump: Mapping[str, Any]) -> bool | None:
    for config in dump.get("configs", []):
        cluster = config.get("cluster", {})
        if cluster.get("name") == PICKER_CLUSTER:
            return "transport_socket" in cluster
    return None


def diagnose(view: EnvoyView) -> list[str]:
    """One line per problem found (empty: requests reach the picker)."""
    problems: list[str] = []
    if view.tls is None:
        return [f"Envoy has no `{PICKER_CLUSTER}` cluster: it was not configured by `picker envoy-config`"]
    failed_open = view.ext_proc("failure_mode_allowed")
    failed = view.ext_proc("streams_failed")
    hosts = ", ".join(view.hosts) or "no hosts"
    speaks = "TLS" if view.tls else "plaintext"
    if view.tls and view.cluster("ssl.connection_error"):
        problems.append(f"Envoy speaks TLS to the picker ({hosts}) and the handshake fails: the picker serves "
                        "plaintext (--secure-serving=false). Render Envoy with `picker envoy-config --picker-tls "
                        "plaintext`, or run the picker with TLS (its default)")
    elif not view.tls and view.cluster("upstream_cx_destroy_remote_with_active_rq") and (
            view.cluster("upstream_rq_pending_failure_eject") or view.cluster("upstream_cx_protocol_error")):
        # The picker closed the connection before it answered any stream on it: a TLS server reading HTTP/2.
        problems.append(f"Envoy speaks plaintext HTTP/2 to the picker ({hosts}) and the picker closes every "
                        "connection: it expects TLS (its default, --secure-serving). Render Envoy with `picker "
                        "envoy-config --picker-tls tls` (the default), or run the picker with --secure-serving=false")
    if not problems and view.cluster("upstream_cx_connect_fail"):
        # A transport mismatch needs connections the picker accepted: "nothing accepts them" would then be stale
        # (counted while it started, say), so it is said only alone.
        problems.append(f"nothing accepts connections at the picker address Envoy uses ({hosts}): the picker is "
                        "down, or Envoy's --picker-host/--picker-port do not match the picker's address and "
                        "--grpc-port")
    unhealthy = [address for address, flags in view.hosts.items() if "failed_active_hc" in flags]
    if unhealthy and not problems:
        problems.append(f"the picker at {', '.join(unhealthy)} fails Envoy's gRPC health check: it reports "
                        "NOT_SERVING (no endpoints discovered yet, or draining); `picker explain --endpoints` shows "
                        "its pool")
    if view.ext_proc("rejected_header_mutations"):
        refused = _counted(view.ext_proc("rejected_header_mutations"), "header change")
        problems.append(f"Envoy refused {refused} of the picker (each fails its request with disallow_is_error): "
                        "the ext_proc filter's mutation_rules do not allow every header the picker may set or "
                        "remove (docs/protocol.md lists them). With P/D render Envoy with `picker envoy-config "
                        "--disaggregation`")
    if view.ext_proc("message_timeouts"):
        problems.append(f"{_counted(view.ext_proc('message_timeouts'), 'picker answer')} came later than Envoy's "
                        "message_timeout: the picker is overloaded, or the timeout is below its queue TTL")
    if (failed_open or failed) and not problems:
        streams = _counted(failed_open or failed, "ext_proc stream")
        problems.append(f"{streams} failed ({speaks} to {hosts}) without a cause "
                        "Envoy counts: see Envoy's log for the picker cluster")
    if problems and failed_open:
        problems.insert(0, f"{_counted(failed_open, 'request')} failed open (routed round-robin, no prefix or load "
                           "awareness; they carry x-picker-fail-open)")
    return problems


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--envoy-admin", default="http://127.0.0.1:9901",
                        help="Envoy's admin interface (its --admin-port in `picker envoy-config`; default %(default)s)")
    parser.add_argument("--json", action="store_true", help="the findings and counters as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        view = read(args.envoy_admin)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        print(f"picker doctor: {args.envoy_admin}: cannot read Envoy's admin interface ({exc})", file=sys.stderr)
        return 2
    problems = diagnose(view)
    streams = view.ext_proc("streams_started")
    if args.json:
        print(json.dumps({"ok": not problems, "problems": problems, "picker_hosts": view.hosts,
                          "picker_tls": view.tls, "streams_started": streams,
                          "failed_open": view.ext_proc("failure_mode_allowed")}, indent=2))
    elif problems:
        print("\n".join(f"picker doctor: {p}" for p in problems))
    else:
        print(f"picker doctor: ok: Envoy reaches the picker ({'TLS' if view.tls else 'plaintext'}, "
              f"{', '.join(view.hosts) or 'no hosts'}); {_counted(streams, 'ext_proc stream')}, none failed open")
    return 1 if problems else 0
