"""A metrics outage is not an outage, through real Envoy: pods whose metrics cannot be read but which answer are
degraded and keep serving; a pod that cannot be reached gets no traffic."""

from __future__ import annotations

import socket
import urllib.request
from collections import Counter

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.supervisor import Envoy, Picker, process_scope, start_backends, start_envoy, start_picker
from tests.waiting import eventually


def _states(picker: Picker) -> dict[tuple[str, str], float]:
    """picker_endpoint_state by (pod, state)."""
    url = f"http://{picker.host}:{picker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as response:
        return {(s.labels["model_server_pod"], s.labels["state"]): s.value
                for family in text_string_to_metric_families(response.read().decode())
                for s in family.samples if s.name == "picker_endpoint_state"}


def _in_state(picker: Picker, pods: list[str], state: str) -> bool:
    states = _states(picker)
    return all(states.get((pod, state)) == 1.0 for pod in pods)


async def _send(envoy: Envoy, n: int) -> tuple[Counter[int], Counter[str]]:
    statuses: Counter[int] = Counter()
    served: Counter[str] = Counter()
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            body = {"model": "tiny", "prompt": f"request {i} " * 40, "max_tokens": 3}
            async with session.post(f"{envoy.url}/v1/completions", json=body) as response:
                statuses[response.status] += 1
                if response.status == 200:
                    served[(await response.json())["served_by"]] += 1
    return statuses, served


async def test_metrics_port_where_nothing_listens_degrades_the_pods_and_every_request_is_served() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nothing = closed.getsockname()[1]
    with process_scope("degraded-envoy") as (logdir, started):
        first = start_backends(1, logdir, name="pod-a")
        started.append(first.process)
        second = start_backends(1, logdir, name="pod-b")
        started.append(second.process)
        pods = [*first.addresses, *second.addresses]
        picker = start_picker(logdir, endpoints=pods, extra=["--model-server-metrics-port", str(nothing)])
        started.append(picker.process)
        envoy = start_envoy(logdir, picker, pods)
        started.append(envoy.process)

        statuses, served = await _send(envoy, 20)
        assert statuses == {200: 20} and set(served) == set(pods), (statuses, served)
        await eventually(lambda: _in_state(picker, pods, "degraded"), 10.0, "both pods shown degraded")
        log = picker.process.log_path.read_text()
        assert all(f"endpoint {pod} ready -> degraded" in log for pod in pods), log

        second.process.stop()  # its serving port closes too: it cannot be reached
        await eventually(lambda: _in_state(picker, second.addresses, "unready"), 10.0, "pod b unready")
        assert f"endpoint {second.addresses[0]} degraded -> unready" in picker.process.log_path.read_text()
        statuses, served = await _send(envoy, 20)
        assert statuses == {200: 20} and served == {first.addresses[0]: 20}, (statuses, served)
