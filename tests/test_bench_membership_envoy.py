"""The leave-rejoin benchmark's pool change, through a real picker and Envoy: a pod taken out of the endpoints file
gets no more requests and is stopped once idle; the pod that joins gets its share."""

from __future__ import annotations

import functools
import json
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass

from picker_lab.bench.client import SERVED_BY_HEADER
from picker_lab.bench.membership import PoolChange, write_pool
from picker_lab.supervisor import (
    HOST,
    process_scope,
    set_echo_metrics,
    start_backends,
    start_picker_fleet,
    wait_until,
)


@dataclass
class EchoPod:
    """One port of the echo backends process, stopped in name only (the process serves its siblings too)."""

    address: str
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        self.stopped = True


def served_by(url: str, n: int) -> list[str]:
    """Where `n` prompts that share nothing went (so load, not a cached prefix, places them)."""
    out = []
    for _ in range(n):
        payload = json.dumps({"model": "tiny", "prompt": f"question {uuid.uuid4()}", "max_tokens": 4}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=payload,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            out.append(response.headers[SERVED_BY_HEADER])
    return out


def requests_served(pod: EchoPod) -> int:
    with urllib.request.urlopen(pod.url + "/test/count", timeout=5) as response:
        return int(json.load(response)["requests"])


def pool_of(metrics_port: int) -> set[str]:
    """The pods the picker routes over, from its picker_endpoint_state series."""
    with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.split('model_server_pod="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("picker_endpoint_state{") and 'model_server_pod="' in line}


def test_a_pod_leaves_drained_and_a_fresh_one_joins_through_envoy() -> None:
    with process_scope("pool-change") as (logdir, started):
        backends = start_backends(3, logdir)
        started.append(backends.process)
        a, b, c = (EchoPod(address) for address in backends.addresses)
        endpoints = logdir / "endpoints.yaml"
        write_pool(endpoints, [a.address, b.address])
        change = PoolChange(functools.partial(write_pool, endpoints), [a], b, c, leave_s=0.0, rejoin_s=0.0,
                            last_words=lambda: requests_served(b), drain_s=5.0)
        fleet = start_picker_fleet(logdir, [a.address, b.address], name="picker-pool-change", served_by=SERVED_BY_HEADER,
                                   endpoints_file=endpoints)
        started += fleet.processes
        metrics_port = fleet.pickers[0].metrics_port
        wait_until(lambda: pool_of(metrics_port) == {a.address, b.address}, 15, "the picker reads both pods")
        assert set(served_by(fleet.envoy.url, 12)) == {a.address, b.address}

        set_echo_metrics(b.address, running=1)  # b is still busy with a request: it may finish it first
        began = time.monotonic()
        leaving = threading.Thread(target=change.leave, args=(began, threading.Event()))
        leaving.start()
        wait_until(lambda: pool_of(metrics_port) == {a.address}, 15, "the picker drops the leaving pod")
        assert not b.stopped and [what for what, _ in change.events] == ["left"]
        set_echo_metrics(b.address, running=0)
        leaving.join(15)
        assert b.stopped and [what for what, _ in change.events] == ["left", "stopped"]
        assert change.last >= 1  # what it served, read before it stopped
        assert set(served_by(fleet.envoy.url, 12)) == {a.address}

        change.join(began)
        wait_until(lambda: pool_of(metrics_port) == {a.address, c.address}, 15, "the picker adds the fresh pod")
        assert set(served_by(fleet.envoy.url, 12)) == {a.address, c.address}
        assert [what for what, _ in change.events] == ["left", "stopped", "joined"]


def test_write_pool_replaces_the_file_in_one_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "endpoints.yaml"
    write_pool(path, ["127.0.0.1:1", "127.0.0.1:2"])
    write_pool(path, ["127.0.0.1:3"])
    assert path.read_text() == "- 127.0.0.1:3\n" and [p.name for p in tmp_path.iterdir()] == ["endpoints.yaml"]
