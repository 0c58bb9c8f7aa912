"""The overhead benchmark's floor (lab/picker_lab/bench/floor.py), a minimal ext_proc server on grpc.aio or grpclib, routes
through real Envoy as the picker does: every request answered by a pod, round-robin, with Envoy's health checks
passing."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter

import pytest

from picker_lab.bench.floor import start as start_floor
from picker_lab.supervisor import (
    process_scope,
    start_backends,
    start_envoy,
)


@pytest.mark.parametrize("server", ["grpcio", "grpclib"])
def test_the_floor_server_routes_round_robin_through_envoy(server: str) -> None:
    with process_scope("floor") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        floor = start_floor(logdir, backends.addresses, started, server)
        envoy = start_envoy(logdir, floor, backends.addresses, fail_open=False)
        started.append(envoy.process)
        served: Counter[str] = Counter()
        sent = envoy.ext_proc_messages_sent()
        for i in range(6):
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}).encode()
            request = urllib.request.Request(envoy.url + "/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.loads(response.read())
            assert answer["destination_header"] == answer["served_by"]  # routed by the header, not fail-open
            served[answer["served_by"]] += 1
        assert served == {backends.addresses[0]: 3, backends.addresses[1]: 3}
        assert envoy.ext_proc_messages_sent() - sent == 12  # headers and body: the response headers turned off
