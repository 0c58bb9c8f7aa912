"""The picker's own word on refused TLS handshakes at its ext_proc port.

gRPC's C core refuses a handshake below the Python API (no servicer, no interceptor hears of it) and says so only on
stderr, in its own terms (`ssl_transport_security.cc ... Handshake failed ... WRONG_VERSION_NUMBER`): an operator
whose Envoy speaks plaintext to the picker's TLS port sees requests fail open and nothing in the picker's log that
names the cause. So, while the ext_proc port serves TLS, stderr is read through a pipe: every byte is passed on
unchanged, and a failed handshake is also told in the picker's log, once a minute per cause, naming the likely
mismatch and the flag that fixes it. The pipe's reader never logs itself: it hands the cause to the event loop,
whose log line goes through the pipe like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable

from picker.core.quietlog import QuietLog

log = logging.getLogger(__name__)

MARKER = b"Handshake failed"
# What the TLS library's reason most likely means, and what fixes it (checked in order)
CAUSES: tuple[tuple[tuple[bytes, ...], str], ...] = (
    ((b"WRONG_VERSION_NUMBER", b"HTTP_REQUEST", b"UNKNOWN_PROTOCOL"),
     "a client spoke plaintext to the ext_proc port, which serves TLS (--secure-serving, the default): an Envoy "
     "rendered with `picker envoy-config --picker-tls plaintext`? Render it with --picker-tls tls (the default), or "
     "run the picker with --secure-serving=false"),
    ((b"PEER_DID_NOT_RETURN_A_CERTIFICATE", b"NO_CERTIFICATE"),
     "a client presented no certificate, and the picker asks for one (--client-ca): render Envoy with `picker "
     "envoy-config --picker-client-cert DIR`, or run the picker without --client-ca"),
    ((b"CERTIFICATE_VERIFY_FAILED", b"certificate verify failed", b"UNKNOWN_CA", b"BAD_CERTIFICATE"),
     "a client's certificate is not one --client-ca signed: give Envoy (--picker-client-cert) a certificate of "
     "that CA"),
)
OTHER = "a client's TLS handshake at the ext_proc port failed"


def cause_of(line: bytes) -> str | None:
    """What a line of gRPC's stderr says about a failed handshake, in the picker's words; None for other lines."""
    if MARKER not in line:
        return None
    for needles, cause in CAUSES:
        if any(needle in line for needle in needles):
            return cause
    reason = line.split(MARKER, 1)[1].decode(errors="replace").strip(" :\n")
    return f"{OTHER} ({reason})" if reason else OTHER


class HandshakeWatch:
    """Reads stderr (fd 2) through a pipe while it runs; `stop` gives fd 2 back."""

    def __init__(self, loop: asyncio.AbstractEventLoop, report: Callable[[str], None] | None = None) -> None:
        self.loop = loop
        self.report = report if report is not None else _Reporter().report
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        read_end, write_end = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._thread = threading.Thread(target=self._pump, args=(read_end, self._saved), name="handshake-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """fd 2 back to what it was; the pipe's last writer closed, the reader drains it and ends."""
        if self._saved is None:
            return
        os.dup2(self._saved, 2)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        os.close(self._saved)
        self._saved = None

    def _pump(self, read_end: int, out: int) -> None:
        """Pass everything on; nothing here may stop reading while fd 2 is the pipe (a writer would block)."""
        pending = b""
        try:
            while chunk := os.read(read_end, 65536):
                _write_all(out, chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                pending = pending[-4096:]  # a line without its end yet (bounded: whatever writes it)
                for line in lines:
                    cause = cause_of(line)
                    if cause is not None:
                        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody to tell
                            self.loop.call_soon_threadsafe(self.report, cause)
        except OSError:
            pass  # stderr itself gone: nothing to pass on
        finally:
            os.close(read_end)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class _Reporter:
    """One line a minute per cause (a misconfigured Envoy retries every connection)."""

    def __init__(self) -> None:
        self.quiet: dict[str, QuietLog] = {}

    def report(self, cause: str) -> None:
        quiet = self.quiet.setdefault(cause, QuietLog(log, burst=1, window=60.0))
        quiet.log(logging.WARNING, "TLS handshake refused: %s", cause)
