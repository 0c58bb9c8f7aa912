"""`picker pd-sidecar` on its own, in front of an echo backend as its decode engine: what it does with no header,
a refused target, an unreachable prefill pod and a body that is not JSON, and a bad flag."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

from picker.serving.pd_sidecar import prefill_headers
from picker_lab.supervisor import (
    HOST,
    free_port,
    port_open,
    process_scope,
    spawn,
    start_backends,
    wait_until,
)


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def counters(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                if line.startswith("picker_pd_sidecar_") and "_total{" in line}


def test_the_sidecar_refuses_targets_outside_its_allowlist_and_falls_back_on_a_failed_prefill() -> None:
    with process_scope("pd-sidecar") as (logdir, started):
        backends = start_backends(1, logdir)
        started.append(backends.process)
        decoder = backends.addresses[0]
        port, metrics_port, closed = free_port(), free_port(), free_port()
        started.append(spawn("sidecar", [sys.executable, "-m", "picker", "pd-sidecar", "--host", HOST, "--port",
                                         str(port), "--model-server-port", decoder.rsplit(":", 1)[1],
                                         "--metrics-port", str(metrics_port), "--allowed-prefillers",
                                         "127.0.0.2/32", "--prefill-timeout", "5"], logdir))
        wait_until(lambda: port_open(port) and port_open(metrics_port), 20, "sidecar")
        url, body = f"http://{HOST}:{port}", json.dumps({"model": "m", "prompt": "hello"}).encode()

        status, answer = post(url, body, {})
        assert status == 200 and answer["served_by"] == decoder  # no header: straight to the decode engine
        status, answer = post(url, body, {"x-prefiller-host-port": f"127.0.0.1:{closed}"})
        assert status == 403 and answer["error"]["code"] == "prefiller_not_allowed"
        status, answer = post(url, body, {"x-prefiller-host-port": f"127.0.0.2:{closed}"})  # allowed, nobody there
        assert status == 200 and answer["served_by"] == decoder
        status, answer = post(url, b"{not json", {"x-prefiller-host-port": f"127.0.0.2:{closed}"})
        assert status == 200 and answer["body_bytes"] == 9  # the engine gets it as it came (vLLM answers 400)
        seen = counters(f"{HOST}:{metrics_port}")
        assert seen['picker_pd_sidecar_requests_total{prefill="local"}'] == 1
        assert seen['picker_pd_sidecar_requests_total{prefill="fallback"}'] == 2
        assert seen['picker_pd_sidecar_prefill_fallbacks_total{reason="unreachable"}'] == 1
        assert seen['picker_pd_sidecar_prefill_fallbacks_total{reason="bad_body"}'] == 1


def test_a_bad_allowlist_is_refused_naming_the_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "picker", "pd-sidecar", "--allowed-prefillers", "10.0.0.0/8,pods"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "allowed-prefillers: 'pods' is not an IP address or CIDR block" in result.stderr


def test_the_prefill_leg_carries_the_prefill_pods_rank_never_the_decode_engines() -> None:
    decode = {"x-request-id": "r1", "X-data-parallel-rank": "1", "authorization": "Bearer t"}
    assert prefill_headers(decode, "3") == {"x-request-id": "r1", "authorization": "Bearer t",
                                            "x-data-parallel-rank": "3"}
    assert prefill_headers(decode, "") == {"x-request-id": "r1", "authorization": "Bearer t"}
    assert prefill_headers(decode, "-1") == prefill_headers(decode, "one") == prefill_headers(decode, "")
