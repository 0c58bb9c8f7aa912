"""TLS on the ext_proc port, as the reference endpoint picker serves it.

Secure serving is on by default (GIE's `--secure-serving`): with no `--cert-path` the picker makes a self-signed
pair at start, and gateways talk to it with TLS and no verification (GIE's integrations do exactly that). With
`--cert-path DIR` (tls.crt + tls.key, a mounted Secret) the pair is read from there, and re-read on change with
`--enable-cert-reload` (checked on each new connection: Envoy holds its HTTP/2 connections, so that is rare).
`--client-ca FILE` asks every client for a certificate signed by that CA (mTLS). The health port stays plaintext:
Kubernetes gRPC probes and Envoy's health checker talk to it without TLS.

The client side (`picker explain`, the demo, the tests) can pin a CA, or accept what the server presents, as a
gateway with no verification does.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

CERT_FILE, KEY_FILE = "tls.crt", "tls.key"  # the names of a kubernetes.io/tls Secret's keys, as GIE expects
# grpcio's TLS stack offers TLS 1.2 and 1.3 and cannot be told to refuse 1.2: a floor of 1.2 or lower is what it
# does already; a floor of 1.3 cannot be honoured, and is refused rather than silently ignored.
TLS_VERSIONS = ("VersionTLS10", "VersionTLS11", "VersionTLS12", "VersionTLS13")
_HONOURED_VERSIONS = TLS_VERSIONS[:3]


class TlsError(ValueError):
    """A certificate, key or CA that cannot serve, naming the file and the flag it came from."""


@dataclass(frozen=True, slots=True)
class PemPair:
    certificate: bytes
    private_key: bytes


def self_signed(hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> PemPair:
    """A fresh P-256 key and a 10-year self-signed server certificate naming `hosts` (DNS names or IPs)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return _issue(key, hosts, issuer=None, server=True)


def _issue(key: ec.EllipticCurvePrivateKey, hosts: tuple[str, ...], *, issuer: PemPair | None, server: bool,
           ca: bool = False) -> PemPair:
    """A certificate for `key` naming `hosts`, signed by `issuer` (None: by itself)."""
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "picker"),
                      x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "picker")])
    now = datetime.datetime.now(datetime.UTC)
    signer_key: ec.EllipticCurvePrivateKey = key
    issuer_name = name
    if issuer is not None:
        signer = x509.load_pem_x509_certificate(issuer.certificate)
        loaded = serialization.load_pem_private_key(issuer.private_key, None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        signer_key, issuer_name = loaded, signer.subject
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                                        critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    certificate = builder.sign(signer_key, hashes.SHA256())
    return PemPair(certificate.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


@dataclass(frozen=True, slots=True)
class Pki:
    """A throwaway CA with a server and a client certificate it signed: mTLS for the demo and the tests."""

    ca: PemPair
    server: PemPair
    client: PemPair

    def write(self, directory: Path) -> None:
        """ca.crt, server/tls.{crt,key} and client/tls.{crt,key}: the layout of mounted Secrets."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ca.crt").write_bytes(self.ca.certificate)
        for name, pair in (("server", self.server), ("client", self.client)):
            (directory / name).mkdir(parents=True, exist_ok=True)
            write_pair(directory / name, pair)


def make_pki(server_hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> Pki:
    ca = _issue(ec.generate_private_key(ec.SECP256R1()), ("picker test CA",), issuer=None, server=False, ca=True)
    server = _issue(ec.generate_private_key(ec.SECP256R1()), server_hosts, issuer=ca, server=True)
    client = _issue(ec.generate_private_key(ec.SECP256R1()), ("envoy",), issuer=ca, server=False)
    return Pki(ca, server, client)


def write_pair(directory: Path, pair: PemPair) -> None:
    (directory / CERT_FILE).write_bytes(pair.certificate)
    key = directory / KEY_FILE
    key.touch(mode=0o600)
    key.write_bytes(pair.private_key)


def read_pair(directory: Path, flag: str = "--cert-path") -> PemPair:
    """tls.crt and tls.key from `directory`, checked to be a matching PEM pair; TlsError naming the flag."""
    cert, key = directory / CERT_FILE, directory / KEY_FILE
    try:
        pair = PemPair(cert.read_bytes(), key.read_bytes())
    except OSError as exc:
        raise TlsError(f"{flag} {directory}: {exc.strerror or exc}: {exc.filename}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsError(f"{flag} {directory}: {CERT_FILE} and {KEY_FILE} are no matching PEM certificate and "
                       f"key ({exc.reason or exc})") from None
    return pair


def read_ca(path: Path, flag: str = "--client-ca") -> bytes:
    try:
        pem = path.read_bytes()
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except OSError as exc:
        raise TlsError(f"{flag} {path}: {exc.strerror or exc}") from None
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise TlsError(f"{flag} {path}: no PEM CA certificate ({exc})") from None
    return pem


def check_min_version(version: str) -> str:
    if version not in TLS_VERSIONS:
        raise TlsError(f"--tls-min-version {version!r}: choose from {', '.join(TLS_VERSIONS)}")
    if version not in _HONOURED_VERSIONS:
        raise TlsError(f"--tls-min-version {version}: grpcio's TLS stack cannot refuse TLS 1.2 (it offers 1.2 and "
                       "1.3); use VersionTLS12, or terminate TLS in front of the picker")
    return version


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """The serve options that shape the ext_proc port's TLS."""

    secure: bool = True
    cert_path: str = ""
    reload: bool = False
    client_ca: str = ""
    min_version: str = "VersionTLS12"

    def check(self) -> None:
        """Read everything once, so a bad file is a start-up error naming its flag, not a failed handshake."""
        check_min_version(self.min_version)
        if self.reload and not self.cert_path:
            raise TlsError("--enable-cert-reload needs --cert-path (a self-signed pair is never re-read)")
        if not self.secure:
            if self.client_ca:
                raise TlsError("--client-ca needs secure serving (drop --secure-serving=false)")
            return
        if self.cert_path:
            read_pair(Path(self.cert_path))
        if self.client_ca:
            read_ca(Path(self.client_ca))


class _ReloadingCertificates:
    """Re-reads --cert-path when tls.crt or tls.key change; grpc asks before every handshake (its own thread)."""

    def __init__(self, directory: Path, client_ca: bytes | None) -> None:
        self.directory = directory
        self.client_ca = client_ca
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._failed_stamp: tuple[int, ...] | None = None

    def _stat(self) -> tuple[int, ...]:
        """Change stamp of the pair: a Secret update swaps a symlink (new inode) or rewrites (new mtime)."""
        try:
            stats = [(self.directory / name).stat() for name in (CERT_FILE, KEY_FILE)]
        except OSError:
            return ()
        return tuple(x for st in stats for x in (st.st_mtime_ns, st.st_ino, st.st_size))

    def configuration(self, pair: PemPair) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(pair.private_key, pair.certificate)],
                                                         root_certificates=self.client_ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None: keep serving the current pair (unchanged, or the new files are not a valid pair yet)."""
        stamp = self._stat()
        with self._lock:
            if not stamp or stamp == self._stamp or stamp == self._failed_stamp:
                return None
            try:
                pair = read_pair(self.directory)
            except TlsError as exc:
                self._failed_stamp = stamp  # a Secret update lands file by file: wait for the next change
                log.warning("certificate reload failed, still serving the previous pair: %s", exc)
                return None
            self._stamp = stamp
        log.info("reloaded the TLS certificate from %s", self.directory)
        return self.configuration(pair)


def server_credentials(options: TlsOptions, hosts: tuple[str, ...]) -> grpc.ServerCredentials | None:
    """Credentials for the ext_proc port; None when secure serving is off."""
    if not options.secure:
        return None
    client_ca = read_ca(Path(options.client_ca)) if options.client_ca else None
    mutual = client_ca is not None
    if not options.cert_path:
        pair = self_signed(hosts)
        return grpc.ssl_server_credentials([(pair.private_key, pair.certificate)], root_certificates=client_ca,
                                           require_client_auth=mutual)
    directory = Path(options.cert_path)
    pair = read_pair(directory)
    if not options.reload:
        return grpc.ssl_server_credentials([(pair.private_key, pair.certificate)], root_certificates=client_ca,
                                           require_client_auth=mutual)
    certificates = _ReloadingCertificates(directory, client_ca)
    return grpc.dynamic_ssl_server_credentials(certificates.configuration(pair), certificates.fetch,
                                               require_client_authentication=mutual)


def certificate_hosts(bind_host: str) -> tuple[str, ...]:
    """Names a self-signed certificate carries: localhost, loopback, this host's name and the bound address."""
    hosts = ["localhost", "127.0.0.1", socket.gethostname()]
    if bind_host not in ("", "0.0.0.0", "::"):
        hosts.append(bind_host)
    return tuple(dict.fromkeys(hosts))


# Client side --------------------------------------------------------------------------------------------


def presented_certificate(host: str, port: int, timeout: float = 5.0) -> bytes:
    """The certificate a TLS server presents, unverified (what a gateway with no verification accepts)."""
    return ssl.get_server_certificate((host, port), timeout=timeout).encode("ascii")


def _first_name(certificate_pem: bytes) -> str:
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = None
    if names is not None:
        for name in names:
            return str(name.value)
    common = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(common[0].value) if common else "localhost"


def client_credentials(target: str, *, ca: bytes | None = None, client: PemPair | None = None,
                       server_name: str = "") -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """Credentials and channel options for a TLS picker at `target` ("host:port"): verified against `ca`, or
    trusting the certificate it presents now (OSError, ssl.SSLError among them, when nothing speaks TLS there).
    `server_name` overrides the name checked against the certificate (default: the target's host with a CA,
    the certificate's own first name without)."""
    host, _, port = target.rpartition(":")
    roots = ca if ca is not None else presented_certificate(host.strip("[]"), int(port))
    credentials = grpc.ssl_channel_credentials(root_certificates=roots,
                                               private_key=client.private_key if client else None,
                                               certificate_chain=client.certificate if client else None)
    name = server_name or ("" if ca is not None else _first_name(roots))
    return credentials, [("grpc.ssl_target_name_override", name)] if name else []
