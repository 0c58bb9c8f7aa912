"""Data-parallel ranks in precise mode, through real Envoy: two simulated vLLM servers of two ranks each, every
engine publishing its own KV events as vLLM's do (rank r on the picker's endpoint port + r, r in the payload, a
sequence of its own, under the server's topic). Traffic sent around the picker, each prefix to one rank by
`X-data-parallel-rank`, warms that rank alone; the rank's events reach the picker's view of that rank, and requests
with the prefix through Envoy go to that rank of that server, served from its cache."""

from __future__ import annotations

import itertools
import json
import random
import urllib.request
from collections.abc import Iterator

import pytest

from picker_lab.bench.workloads import WORDS
from picker_lab.supervisor import (
    process_scope,
    start_envoy,
    start_picker,
    wait_until,
)
from tests.test_data_parallel_envoy import rank_counters, targets
from tests.test_precise_envoy import SIM_FLAGS, PublishingStack, series, start_publishing_pods


@pytest.fixture(scope="module")
def ranked() -> Iterator[PublishingStack]:
    with process_scope("data-parallel-precise") as (logdir, started):
        pods, endpoint, replay = start_publishing_pods(logdir, started, [*SIM_FLAGS, "--data-parallel-size", "2"],
                                                       first_host=40, ranks=2)
        addresses = [a for p in pods for a in p.addresses]
        picker = start_picker(logdir, endpoints=addresses, extra=[
            "--kv-events-endpoint", endpoint, "--kv-events-replay-port", str(replay),
            "--metrics-slow-interval", "200ms"])
        started.append(picker.process)
        wanted = {f"{a}#{r}" for a in addresses for r in (0, 1)}
        wait_until(lambda: set(targets(picker)) == wanted, 20, "the picker routes each rank", picker.process)
        envoy = start_envoy(logdir, picker, addresses, mode="full-duplex")
        started.append(envoy.process)
        yield PublishingStack(pods, picker, envoy)


def complete(url: str, prompt: str, rank: int | None = None) -> dict[str, int]:
    """A completion (sent to `rank` when given): its prompt and cached tokens, and the rank that served it."""
    headers = {"content-type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        usage = json.loads(response.read())["usage"]
        served = int(response.headers["x-sim-rank"])
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "rank": served}


def test_a_prefix_warmed_on_one_rank_is_routed_to_that_rank(ranked: PublishingStack) -> None:
    rng = random.Random(11)
    homes = [(ranked.addresses[0], 1), (ranked.addresses[1], 0)]
    prefixes = []
    fillers = itertools.count()
    for address, rank in homes:
        prefix = " ".join(rng.choice(WORDS) for _ in range(600))  # ~40 blocks of 16 tokens
        target = f"{address}#{rank}"
        complete(f"http://{address}", prefix + " warm-up", rank)
        # until that rank's publisher reached the picker: its blocks show in the picker's view of the rank (a first
        # message sent before the publisher had connected is lost, and the next one, a filler's, shows the gap:
        # replayed from that rank's own replay socket)
        wait_until(lambda: complete(f"http://{address}", f"filler {next(fillers)} " * 20, rank) is not None  # noqa: B023
                   and series(ranked.picker, "picker_precise_blocks").get(target, 0) > 20,  # noqa: B023
                   20, f"{target}'s KV events in the picker's view", ranked.picker.process.proc)
        prefixes.append(prefix)
    views = series(ranked.picker, "picker_precise_blocks")
    assert not set(views) & set(ranked.addresses), views  # every view is a rank's, none a whole server's
    before = {a: rank_counters(a) for a in ranked.addresses}
    for (address, rank), prefix in zip(homes, prefixes, strict=True):
        served = [complete(ranked.envoy.url, prefix + f" question {i}") for i in range(4)]
        assert all(s["rank"] == rank for s in served), served
        assert all(s["cached"] >= 0.8 * (s["prompt"] - 16) for s in served), served  # from that rank's cache
        after = rank_counters(address)
        assert after[rank]["requests"] - before[address][rank]["requests"] == 4
        assert after[rank]["steered"] - before[address][rank]["steered"] == 4  # the picker named the rank
