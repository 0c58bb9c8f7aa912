"""TLS on the ext_proc port through real Envoy: the default (a self-signed certificate, Envoy not verifying, as
GIE's gateway integrations do), mTLS with a CA both sides check, certificate reload, and refusals: a plaintext
client of a TLS picker, a client without a certificate of an mTLS picker. The health port stays plaintext."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from picker.api.v1 import picker_pb2, picker_pb2_grpc
from picker.serving.config import ConfigError, add_arguments, resolve
from picker.serving.tls import make_pki, presented_certificate, self_signed, write_pair
from picker_lab.supervisor import (
    Backends,
    Managed,
    Picker,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
)
from tests.waiting import eventually

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "over TLS"}]}).encode()


def post(url: str) -> tuple[int, str]:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=BODY,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture(scope="module")
def scope() -> Iterator[tuple[Path, list[Managed], Backends]]:
    with process_scope("tls") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        yield logdir, started, backends


def picker_of(scope: tuple[Path, list[Managed], Backends], tls: str, **kw: object) -> Picker:
    logdir, started, backends = scope
    picker = start_picker(logdir, endpoints=backends.addresses, tls=tls, name=f"picker-{tls}-{len(started)}",
                          **kw)  # type: ignore[arg-type]
    started.append(picker.process)
    return picker


async def listed(picker: Picker) -> set[str]:
    async with picker.aio_channel() as channel:
        listing = await picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest(),
                                                                          timeout=5)
    return {e.address for e in listing.endpoints}


async def test_default_tls_through_envoy_and_plaintext_clients_are_refused(scope: tuple[Path, list[Managed],
                                                                                        Backends]) -> None:
    logdir, started, backends = scope
    picker = picker_of(scope, "tls")
    envoy = start_envoy(logdir, picker, backends.addresses, fail_open=False, name="envoy-tls")
    started.append(envoy.process)  # start_envoy waited for a healthy picker: the plaintext health check works
    for _ in range(3):
        status, text = post(envoy.url)
        assert status == 200, text
        assert json.loads(text)["served_by"] in backends.addresses
    assert await listed(picker) == set(backends.addresses)  # picker.v1 shares the TLS port
    async with grpc.aio.insecure_channel(picker.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert picker.process.alive()
    assert explain(picker, "--endpoints").splitlines()[0].startswith("127.0.0.1:")  # trusts what it presents
    plaintext = explained(picker, "--plaintext", "--endpoints")
    assert plaintext.returncode == 1 and "it serves TLS" in plaintext.stderr and "drop --plaintext" in \
        plaintext.stderr, plaintext.stderr


async def test_mutual_tls_through_envoy_and_clients_without_a_certificate_are_refused(
        scope: tuple[Path, list[Managed], Backends]) -> None:
    logdir, started, backends = scope
    picker = picker_of(scope, "mtls")
    assert picker.pki is not None
    envoy = start_envoy(logdir, picker, backends.addresses, fail_open=False, name="envoy-mtls")
    started.append(envoy.process)
    status, text = post(envoy.url)
    assert status == 200, text
    assert await listed(picker) == set(backends.addresses)
    # Envoy (fail-closed) without a client certificate: the handshake is refused, so every request is a 500.
    anonymous = start_envoy(logdir, picker, backends.addresses, fail_open=False, name="envoy-anonymous",
                            client_cert=False)
    started.append(anonymous.process)
    assert post(anonymous.url)[0] == 500
    await eventually(lambda: "TLS handshake refused: a client presented no certificate" in picker.process.log(), 10,
                     "the picker's own line for the refused handshake")  # logged from its event loop, a moment later
    credentials = grpc.ssl_channel_credentials(root_certificates=(picker.pki / "ca.crt").read_bytes())
    async with grpc.aio.secure_channel(picker.target, credentials,
                                       options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await picker_pb2_grpc.PickerStub(channel).ListEndpoints(picker_pb2.ListEndpointsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert picker.process.alive()
    assert explain(picker, "--endpoints", "--ca", str(picker.pki / "ca.crt"), "--client-cert",
                   str(picker.pki / "client"), "--server-name", "localhost").startswith("127.0.0.1:")


def explained(picker: Picker, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker", "explain", "--target", picker.target, *args],
                          capture_output=True, text=True, timeout=30)


def explain(picker: Picker, *args: str) -> str:
    result = explained(picker, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_a_renewed_certificate_is_served_to_new_connections(
        scope: tuple[Path, list[Managed], Backends], tmp_path: Path) -> None:
    first, second = self_signed(), self_signed()
    write_pair(tmp_path, first)
    picker = picker_of(scope, "tls", extra=["--cert-path", str(tmp_path), "--enable-cert-reload"])
    assert presented_certificate(picker.host, picker.grpc_port) == first.certificate
    (tmp_path / "tls.crt").write_bytes(b"half-written")  # a Secret update seen mid-way: keep the old pair
    assert presented_certificate(picker.host, picker.grpc_port) == first.certificate
    staged = tmp_path / "staged"
    staged.mkdir()
    write_pair(staged, second)
    for name in ("tls.key", "tls.crt"):
        shutil.move(staged / name, tmp_path / name)
    await eventually(lambda: presented_certificate(picker.host, picker.grpc_port) == second.certificate, 10,
                     "the renewed certificate is served")
    assert "certificate reload failed" in picker.process.log()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--endpoints", "127.0.0.1:8000", *argv])


def test_tls_flags_take_the_reference_pickers_spelling_and_bad_files_name_their_flag(tmp_path: Path) -> None:
    assert resolve(parse()).secure_serving is True
    assert resolve(parse("--secure-serving=false")).secure_serving is False
    assert resolve(parse("--secure-serving")).secure_serving is True
    pki = make_pki()
    pki.write(tmp_path)
    ok = resolve(parse("--cert-path", str(tmp_path / "server"), "--client-ca", str(tmp_path / "ca.crt"),
                       "--enable-cert-reload=true"))
    assert ok.tls.client_ca and ok.tls.reload
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tls.crt").write_bytes(pki.server.certificate)
    (tmp_path / "bad" / "tls.key").write_bytes(pki.client.private_key)  # not this certificate's key
    for argv, message in [
        (["--tls-min-version", "VersionTLS13"], "--tls-min-version VersionTLS13"),
        (["--tls-min-version", "tls1.2"], "choose from"),
        (["--cert-path", str(tmp_path / "missing")], "--cert-path"),
        (["--cert-path", str(tmp_path / "bad")], "no matching PEM certificate and key"),
        (["--enable-cert-reload"], "--enable-cert-reload needs --cert-path"),
        (["--client-ca", str(tmp_path / "server" / "tls.key")], "--client-ca"),
        (["--secure-serving=false", "--client-ca", str(tmp_path / "ca.crt")], "--client-ca needs secure serving"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            resolve(parse(*argv))
    with pytest.raises(SystemExit):
        parse("--secure-serving=maybe")
