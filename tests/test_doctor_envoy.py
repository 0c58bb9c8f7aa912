"""A picker Envoy cannot talk to fails open in silence; `picker doctor` names why from Envoy's admin interface, and
every fail-open response says so in a header. Each mismatch through real Envoy."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import urllib.request

import pytest

from picker.tools import doctor
from picker_lab.supervisor import (
    Picker,
    free_port,
    process_scope,
    start_backends,
    start_envoy,
    start_picker,
    wait_until,
)

CASES: dict[str, tuple[str, str, str]] = {
    # what the picker serves, what Envoy is told it serves (or "wrong-port"), and what doctor must say
    "plaintext picker, TLS Envoy": ("plaintext", "tls", "the picker serves plaintext (--secure-serving=false)"),
    "TLS picker, plaintext Envoy": ("tls", "plaintext", "it expects TLS"),
    "wrong picker port": ("plaintext", "wrong-port", "nothing accepts connections at the picker address"),
    "matching": ("plaintext", "plaintext", ""),
}


def as_told(picker: Picker, told: str) -> Picker:
    """The picker as Envoy's config describes it."""
    if told == "wrong-port":
        return dataclasses.replace(picker, grpc_port=free_port())
    return dataclasses.replace(picker, tls=told, pki=None)


def _post(url: str) -> tuple[int, str]:
    request = urllib.request.Request(f"{url}/v1/completions", data=b'{"model": "tiny", "prompt": "fail open?"}',
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers.get("x-picker-fail-open", "")


def _doctor(admin_port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker", "doctor", "--envoy-admin", f"http://127.0.0.1:{admin_port}"],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("case", list(CASES))
def test_doctor_names_each_mismatch_within_a_minute_of_traffic(case: str) -> None:
    serves, told, cause = CASES[case]
    with process_scope("doctor") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        picker = start_picker(logdir, endpoints=backends.addresses, tls=serves)
        started.append(picker.process)
        envoy = start_envoy(logdir, as_told(picker, told), backends.addresses, wait_for_picker=not cause)
        started.append(envoy.process)
        began = time.monotonic()
        answers = [_post(envoy.url) for _ in range(5)]
        assert [status for status, _ in answers] == [200] * 5  # fail open: every client still gets an answer
        if not cause:
            assert all(header == "" for _, header in answers), answers
            result = _doctor(envoy.admin_port)
            assert result.returncode == 0 and "ok: Envoy reaches the picker" in result.stdout, result
            return
        assert all(header.startswith("round-robin") for _, header in answers), answers
        result = _doctor(envoy.admin_port)
        while result.returncode != 1 and time.monotonic() - began < 60:
            time.sleep(0.5)  # Envoy's counters lag its health checks by at most one interval
            result = _doctor(envoy.admin_port)
        if serves == "tls":  # the picker's own line comes from its event loop, a moment after gRPC's
            wait_until(lambda: "TLS handshake refused" in picker.process.log(), 10, "the picker's handshake line")
        picker_log = picker.process.log()  # read before the scope removes its folder
    assert result.returncode == 1 and cause in result.stdout, result
    if serves == "tls":  # the picker says so in its own log too, once, naming the flag
        said = [line for line in picker_log.splitlines() if "TLS handshake refused" in line]
        assert said and "--picker-tls tls" in said[0], picker_log[-2000:]  # once a minute: one line here
    # one diagnosis, after the count of what failed open
    first, *diagnoses = result.stdout.splitlines()
    assert first.startswith("picker doctor: 5 requests failed open") and len(diagnoses) == 1, result.stdout


def test_counts_are_said_in_the_singular_too() -> None:
    view = doctor.EnvoyView({"http.inference.ext_proc.failure_mode_allowed": 1,
                             "cluster.picker.upstream_cx_connect_fail": 1}, {"127.0.0.1:9002": "healthy"}, tls=False)
    first, second = doctor.diagnose(view)
    assert first.startswith("1 request failed open") and second.startswith("nothing accepts connections")
