"""Model servers named by host (`--endpoints localhost:8000`, as docker-compose services and headless Services are
reached) route through real Envoy: the picker resolves the name and names the address in its header."""

from __future__ import annotations

import json
import urllib.request

from picker_lab.supervisor import process_scope, start_backends, start_envoy, start_picker


def test_endpoints_given_by_name_route_to_their_addresses() -> None:
    with process_scope("names") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        named = [a.replace("127.0.0.1", "localhost") for a in backends.addresses]
        picker = start_picker(logdir, endpoints=named)
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, backends.addresses)
        started.append(envoy.process)
        served = set()
        for i in range(6):
            body = json.dumps({"model": "tiny", "prompt": f"{i} a prompt of its own"}).encode()
            request = urllib.request.Request(envoy.url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.loads(response.read())
            assert answer["destination_header"] == answer["served_by"] in backends.addresses
            served.add(answer["served_by"])
        assert served == set(backends.addresses)
        assert "endpoint localhost" not in picker.process.log()  # both resolved at once, no warning
