"""Precise prefix routing through real Envoy: traffic that reaches one pod around the picker (sent to it directly)
warms a long prefix there; the pod's KV events tell the picker, so a request with that prefix through Envoy goes
to that pod (it is served from its cache). A picker on the approximate index alone never saw that traffic.

Each `picker sim` pod runs on its own loopback address (as pods have IPs of their own) and publishes to the one
endpoint the picker binds, under `kv@<ip>:<port>@<model>`, with its replay socket on the same port of its IP."""

from __future__ import annotations

import functools
import json
import random
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker_lab.bench.workloads import WORDS
from picker_lab.supervisor import (
    Backends,
    Envoy,
    Managed,
    Picker,
    Valkey,
    free_port,
    free_port_range,
    process_scope,
    start_envoy,
    start_picker,
    start_picker_fleet,
    start_sim,
    wait_until,
)

SIM_FLAGS = ["--profile", "tiny-cpu", "--block-size", "16", "--time-scale", "20"]


@dataclass
class Stack:
    pods: list[Backends]
    precise: Picker
    envoy: Envoy
    approximate: Envoy

    @property
    def addresses(self) -> list[str]:
        return [a for p in self.pods for a in p.addresses]


@dataclass
class PublishingStack:
    """Pods publishing their KV events, the picker that follows them, and its Envoy."""

    pods: list[Backends]
    picker: Picker
    envoy: Envoy

    @property
    def addresses(self) -> list[str]:
        return [a for p in self.pods for a in p.addresses]


def start_publishing_pods(logdir: Path, started: list[Managed], flags: list[str], first_host: int,
                          count: int = 2, ranks: int = 1) -> tuple[list[Backends], str, int]:
    """`count` sim pods, each on its own loopback address, publishing their KV events to one endpoint (the picker
    binds it) with a replay socket each: the pods, the endpoint and the replay port. Pods first: the static pool
    names their addresses. With data-parallel `ranks`, rank r publishes (and replays) on the port + r."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port_range(ranks)}", free_port_range(ranks)
    pods = []
    for i in range(count):
        sim = start_sim(1, logdir, host=f"127.0.0.{first_host + i}", name=f"sim-{i}", extra=[
            *flags, "--kv-events-endpoint", endpoint, "--kv-events-replay-port-base", str(replay)])
        started.append(sim.process)
        pods.append(sim)
    return pods, endpoint, replay


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with process_scope("precise") as (logdir, started):
        pods, endpoint, replay = start_publishing_pods(logdir, started, SIM_FLAGS, first_host=20)
        addresses = [a for p in pods for a in p.addresses]
        precise = start_picker(logdir, endpoints=addresses, name="picker-precise", extra=[
            "--kv-events-endpoint", endpoint, "--kv-events-replay-port", str(replay)])
        started.append(precise.process)
        approximate = start_picker(logdir, endpoints=addresses, name="picker-approximate")
        started.append(approximate.process)
        envoys = []
        for picker, name, mode in ((precise, "envoy-precise", "full-duplex"),
                                   (approximate, "envoy-approximate", "buffered")):
            envoys.append(start_envoy(logdir, picker, addresses, name=name, mode=mode))  # full duplex: usage seen
            started.append(envoys[-1].process)
        yield Stack(pods, precise, envoys[0], envoys[1])


def complete(url: str, prompt: str) -> dict[str, int]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        usage = json.loads(response.read())["usage"]
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def series(picker: Picker, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{picker.host}:{picker.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.labels.get("model_server_endpoint") or s.labels.get("model_server_pod") or s.labels.get("kind", ""):
            s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(name)}


def routed_requests(picker: Picker) -> float:
    """Requests the replica counted (every series of llm_d_epp_request_total)."""
    with urllib.request.urlopen(f"http://{picker.host}:{picker.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "llm_d_epp_request_total")


def test_traffic_around_the_picker_is_seen_through_the_pods_events(stack: Stack) -> None:
    rng = random.Random(3)
    warm = stack.addresses[0]
    prefix = " ".join(rng.choice(WORDS) for _ in range(600))  # ~40 blocks of 16 tokens
    # until the pods' publishers reached the picker: each direct request's blocks show in its view of the pod
    wait_until(lambda: complete(f"http://{warm}", prefix + " warm-up") is not None
               and series(stack.precise, "picker_precise_blocks").get(warm, 0) > 20, 20,
               "the warm pod's KV events in the picker's view", stack.precise.process.proc)
    assert series(stack.precise, "picker_precise_fresh").get(warm) == 1.0
    served = [complete(stack.envoy.url, prefix + f" question {i}") for i in range(6)]
    # each one served from the warm pod's cache: its prefix hit (a cold pod computes everything)
    assert all(s["cached"] >= 0.8 * (s["prompt"] - 16) for s in served), served
    # what the picker expected the pod to have cached against what the pod reported (usage), per pod
    expected = series(stack.precise, "picker_prefix_expected_tokens_total").get(warm, 0.0)
    reported = series(stack.precise, "picker_prefix_reported_tokens_total").get(warm, 0.0)
    assert expected > 0 and 0.8 * expected <= reported <= 1.3 * expected, (expected, reported)
    problems = series(stack.precise, "picker_kv_events_problems")
    assert problems.get("malformed") == 0 and problems.get("unknown_topic") == 0
    # The approximate picker never saw the warm-up: its first pick is the load's and the tie-break's (either
    # pod), later ones follow its own history; nothing is asserted of it but that it serves.
    assert complete(stack.approximate.url, prefix + " other")["prompt"] > 0


def every_replica_finds_a_prefix_warmed_around_it(replicas: list[Picker], url: str, warm: str,
                                                  rng: random.Random) -> None:
    """Warm a 600-word prefix on pod `warm` by requests sent straight to it, wait until every replica's view of
    the pod holds it, then send 8 requests with it through Envoy: each served from the warm cache, and both
    replicas routed some."""
    prefix = " ".join(rng.choice(WORDS) for _ in range(600))

    def warmed(replica: Picker) -> bool:
        complete(f"http://{warm}", prefix + " warm-up")
        return series(replica, "picker_precise_blocks").get(warm, 0) > 20

    for replica in replicas:
        wait_until(functools.partial(warmed, replica), 20, f"the warm pod's KV events in {replica.host}'s view",
                   replica.process.proc)
    served = [complete(url, prefix + f" question {i}") for i in range(8)]
    assert all(s["cached"] >= 0.8 * (s["prompt"] - 16) for s in served), served
    routed = [routed_requests(r) for r in replicas]
    assert all(n > 0 for n in routed), routed  # both replicas routed some of them


def test_every_replica_follows_every_pod_when_the_pods_bind() -> None:
    """Connect mode (`--kv-events-port`): the pods bind their publishers (vLLM's tcp://*:PORT), each replica
    connects to each pod, so two replicas behind one Envoy hold the same view: a prefix warmed around them is
    found by whichever replica routes the request."""
    rng = random.Random(4)
    with process_scope("precise-replicas") as (logdir, started):
        port, replay = free_port(), free_port()
        pods = []
        for i in range(2):
            sim = start_sim(1, logdir, host=f"127.0.0.{30 + i}", name=f"sim-{i}", extra=[
                *SIM_FLAGS, "--kv-events-bind-port", str(port), "--kv-events-replay-port-base", str(replay)])
            started.append(sim.process)
            pods.append(sim)
        addresses = [a for p in pods for a in p.addresses]
        fleet = start_picker_fleet(logdir, addresses, replicas=2, first_host=40, name="picker-connect", flags=[
            "--kv-events-port", str(port), "--kv-events-replay-port", str(replay)])
        started.extend(fleet.processes)
        every_replica_finds_a_prefix_warmed_around_it(fleet.pickers, fleet.envoy.url, addresses[1], rng)


def test_replicas_bound_for_events_share_them_through_redis(valkey: Valkey) -> None:
    """Bind mode with two replicas and `--index-backend redis`: the pods' publishers reach replica A alone (as a
    Service would send each to one replica); A relays what it hears through Valkey, so B's view has the prefix
    warmed around both, and whichever replica routes a request finds it."""
    rng = random.Random(6)
    with process_scope("precise-relay") as (logdir, started):
        grpc_port, health_port, events_port, replay = free_port(), free_port(), free_port(), free_port()
        hosts = ("127.0.0.50", "127.0.0.51")
        pods = []
        for i in range(2):
            sim = start_sim(1, logdir, host=f"127.0.0.{60 + i}", name=f"sim-{i}", extra=[
                *SIM_FLAGS, "--kv-events-endpoint", f"tcp://{hosts[0]}:{events_port}",
                "--kv-events-replay-port-base", str(replay)])
            started.append(sim.process)
            pods.append(sim)
        addresses = [a for p in pods for a in p.addresses]
        replicas = []
        for i, host in enumerate(hosts):
            replicas.append(start_picker(logdir, endpoints=addresses, name=f"picker-relay-{i}", host=host,
                                         grpc_port=grpc_port, health_port=health_port, extra=[
                                             "--kv-events-endpoint", f"tcp://{host}:{events_port}",
                                             "--kv-events-replay-port", str(replay), "--index-backend", "redis",
                                             "--redis-url", valkey.url, "--index-namespace", "relay-test"]))
            started.append(replicas[-1].process)
        envoy = start_envoy(logdir, replicas, addresses, name="envoy-relay")
        started.append(envoy.process)
        warm = addresses[1]
        # B hears nothing itself: its view comes through the relay
        every_replica_finds_a_prefix_warmed_around_it(replicas, envoy.url, warm, rng)
        assert series(replicas[1], "picker_kv_events_batches").get(warm, 0) > 0
        relayed = [{s.labels["direction"]: s.value for family in text_string_to_metric_families(
            urllib.request.urlopen(f"http://{r.host}:{r.metrics_port}/metrics", timeout=5).read().decode())
            for s in family.samples if s.name == "picker_kv_events_relayed_total"} for r in replicas]
        # A's view came from its socket and went on to B; B's socket heard nothing
        assert relayed[0]["sent"] > 0 and relayed[1]["received"] > 0 and relayed[1]["sent"] == 0, relayed
