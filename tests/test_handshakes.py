"""What the picker makes of gRPC's own line about a refused TLS handshake (picker/serving/handshakes.py); the
lines in a real picker's log are checked through real Envoy (test_doctor_envoy.py, test_tls.py)."""

from __future__ import annotations

import pytest

from picker.serving.handshakes import cause_of

CORE = (b"I1206 13:54:21.771118    8602 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: "
        b"error:100000f7:SSL routines:OPENSSL_internal:%s: Invalid certificate verification context")


@pytest.mark.parametrize(("reason", "said"), [
    (b"WRONG_VERSION_NUMBER", "spoke plaintext to the ext_proc port"),
    (b"HTTP_REQUEST", "spoke plaintext to the ext_proc port"),
    (b"PEER_DID_NOT_RETURN_A_CERTIFICATE", "presented no certificate"),
    (b"CERTIFICATE_VERIFY_FAILED", "not one --client-ca signed"),
    (b"SOMETHING_NEW", "TLS handshake at the ext_proc port failed (with error SSL_ERROR_SSL"),
])
def test_each_reason_gets_its_cause_and_fix(reason: bytes, said: str) -> None:
    cause = cause_of(CORE % reason)
    assert cause is not None and said in cause


def test_other_lines_are_left_alone() -> None:
    assert cause_of(b"I1206 13:54:21 chttp2_transport.cc:100] some other news") is None
    assert cause_of(b"2026-12-06 13:54:21,729 INFO picker: ext_proc on 127.0.0.1:39145") is None
