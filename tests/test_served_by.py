"""The benchmarks' Envoys name the pod that answered (x-served-by): through real Envoy, with and without a picker."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import yaml

from picker.serving.envoyconfig import EnvoySettings, http_managers, instrumented, render
from picker_lab.bench.client import SERVED_BY_HEADER
from picker_lab.bench.live import start_direct_envoy
from picker_lab.bench.real import RealSpec, routing_delays, start_router
from picker_lab.supervisor import process_scope, start_backends, start_picker_fleet


def post(url: str) -> tuple[str, str]:
    """(x-served-by header, the echo pod's own address) of one completion."""
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers.get(SERVED_BY_HEADER, ""), json.load(response)["served_by"]


def test_rendered_config_gains_the_header_on_every_virtual_host() -> None:
    for mode in ("buffered", "full-duplex"):
        text = render(EnvoySettings(pool=("127.0.0.1:8000",), mode=mode))
        assert "%UPSTREAM_HOST%" not in text  # not in what users deploy
        config = yaml.safe_load(instrumented(text, "x-pod"))
        hosts = [h for m in http_managers(config) for h in m.get("route_config", {}).get("virtual_hosts", [])]
        assert hosts and all(h["response_headers_to_add"] == [{"header": {"key": "x-pod", "value": "%UPSTREAM_HOST%"}}]
                             for h in hosts)


def test_served_by_names_the_pod_that_answered_through_envoy() -> None:
    with process_scope("served-by") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, served_by=SERVED_BY_HEADER)
        started.extend(fleet.processes)
        direct, direct_url = start_direct_envoy(logdir, backends.addresses, served_by=SERVED_BY_HEADER)
        started.append(direct)
        seen = set()
        for url in (fleet.envoy.url, direct_url):
            for _ in range(4):
                header, answered = post(url)
                assert header == answered  # the picked pod (ext_proc) and round-robin's alike
                seen.add(header)
        assert seen == set(backends.addresses)  # round-robin visits both


def test_timing_log_times_every_request_through_envoy_with_and_without_a_picker() -> None:
    with process_scope("timing-log") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        fleet = start_picker_fleet(logdir, backends.addresses, timing_log=logdir / "timing-picker.log")
        started.extend(fleet.processes)
        direct, direct_url = start_direct_envoy(logdir, backends.addresses, timing_log=logdir / "timing-direct.log")
        started.append(direct)
        for url, log in ((fleet.envoy.url, "timing-picker.log"), (direct_url, "timing-direct.log")):
            for _ in range(3):
                post(url)
            request, response = routing_delays(logdir / log, 3)
            assert len(request) == len(response) == 3  # one line per request, both spans timed
            assert (request >= 0).all() and (response >= 0).all()


def test_routing_delays_leaves_out_what_envoy_could_not_time(tmp_path: Path) -> None:
    log = tmp_path / "timing.log"
    log.write_text("1500 250\n- -\n2500 -\n")  # the second request never reached a pod, the third no answer
    request, response = routing_delays(log, 3)
    assert request.tolist() == [1.5, 2.5] and response.tolist() == [0.25]


def test_picker_round_robin_routes_through_the_picker_in_turn() -> None:
    """The benchmark's `picker-round-robin`: the picker's path (its Envoy, ext_proc, scrapes) with round-robin's
    decisions, timed by Envoy like every router."""
    with process_scope("picker-rr") as (logdir, started):
        backends = start_backends(2, logdir)
        started.append(backends.process)
        router = start_router("picker-round-robin", RealSpec(), backends.addresses, logdir,
                              timing_log=logdir / "timing-rr.log")
        started.extend(router.processes)
        served = [post(router.url)[1] for _ in range(4)]
        assert sorted(served) == sorted(backends.addresses * 2) and served[0] != served[1]
        request, _ = routing_delays(logdir / "timing-rr.log", 4)
        assert len(request) == 4
