"""Data-parallel ranks behind one port: a server whose metrics page labels several engines (vLLM's
`--data-parallel-size`) is routed as one target per rank, each on its own metrics, in-flight counts and
prefix-index entries, the pick carried in `x-data-parallel-rank`; a single-rank server is routed as before."""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import pytest

from picker.cli import main
from picker.core import headers as names
from picker.core.requests import ApiKind, InferenceRequest
from picker.endpoints.metrics import parse_metrics
from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.endpoints.shared_scrape import SharedSample, _decode, _encode
from picker.endpoints.state import Endpoint, EndpointMetrics
from picker.routing.decision import Decision
from picker.routing.plugins.data_parallel import DataParallelRank
from picker.scheduling.config import build_scheduler
from picker.serving.config import ServeConfig, add_arguments, resolve

IDLE = (Path(__file__).resolve().parent / "data" / "vllm-0.32-cpu-idle.txt").read_text()


def dp_page(waiting: dict[int, float], kv: dict[int, float] | None = None) -> str:
    """vLLM 0.32's page as a server of len(waiting) engines writes it: each engine="0" sample once per engine,
    with that engine's queue and KV use."""
    lines = []
    for line in IDLE.splitlines():
        if 'engine="0"' not in line or line.startswith("#"):
            lines.append(line)
            continue
        for engine in waiting:
            own = line.replace('engine="0"', f'engine="{engine}"')
            if own.startswith("vllm:num_requests_waiting{"):
                own = re.sub(r" [0-9.e+-]+$", f" {waiting[engine]}", own)
            elif own.startswith("vllm:kv_cache_usage_perc{") and kv:
                own = re.sub(r" [0-9.e+-]+$", f" {kv[engine]}", own)
            lines.append(own)
    return "\n".join(lines) + "\n"


def test_a_page_of_two_engines_gives_each_its_own_series_and_their_sum() -> None:
    m = parse_metrics(dp_page({0: 3.0, 1: 5.0}, kv={0: 0.2, 1: 0.6}), updated_at=7.0)
    assert m.waiting == 8.0 and m.kv_usage == pytest.approx(0.4)
    assert m.engines is not None and sorted(m.engines) == [0, 1]
    assert (m.engines[0].waiting, m.engines[1].waiting) == (3.0, 5.0)
    assert (m.engines[0].kv_usage, m.engines[1].kv_usage) == (0.2, 0.6)
    assert m.num_gpu_blocks is not None and m.engines[1].num_gpu_blocks == m.num_gpu_blocks // 2
    assert m.engines[1].block_size == m.block_size
    assert m.engines[1].models == frozenset({"tiny"}) and m.engines[1].updated_at == 7.0


def test_a_real_vllm_page_of_two_data_parallel_ranks() -> None:
    """Captured from vLLM 0.32 CPU run with --data-parallel-size 2 (the tiny local model, blocks of 128 tokens)."""
    page = (Path(__file__).resolve().parent / "data" / "vllm-0.32-cpu-dp2-idle.txt").read_text()
    m = parse_metrics(page)
    assert m.engines is not None and sorted(m.engines) == [0, 1] and m.num_gpu_blocks == 256
    assert [(e.num_gpu_blocks, e.block_size, e.models) for e in m.engines.values()] \
        == [(128, 128, frozenset({"tiny"}))] * 2


def test_one_engine_or_engines_without_their_cache_described_are_not_split() -> None:
    assert parse_metrics(IDLE).engines is None
    partial = IDLE + 'vllm:num_requests_waiting{engine="1",model_name="tiny"} 4\n'  # no cache_config_info for 1
    m = parse_metrics(partial)
    assert m.engines is None and m.waiting == 4.0


def watched(pool: EndpointPool) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    pool.subscribe(lambda event, e: events.append((event.value, e.address)))
    return events


def scraped(pool: EndpointPool, server: Endpoint, page: str) -> None:
    server.metrics = parse_metrics(page, updated_at=1.0)
    pool.metrics_read(server)


def test_a_server_whose_page_labels_engines_becomes_one_target_per_rank() -> None:
    pool = EndpointPool()
    server, other = Endpoint.from_address("10.0.0.5:8000"), Endpoint.from_address("10.0.0.6:8000")
    pool.set_endpoints([server, other])
    events = watched(pool)
    scraped(pool, server, dp_page({0: 1.0, 1: 6.0}))
    assert [e.address for e in pool.ready()] == ["10.0.0.5:8000#0", "10.0.0.5:8000#1", "10.0.0.6:8000"]
    assert events == [("removed", "10.0.0.5:8000"), ("added", "10.0.0.5:8000#0"), ("added", "10.0.0.5:8000#1")]
    rank0, rank1 = pool.ranks(server)
    assert (rank0.rank, rank1.rank, rank1.destination, rank1.name) == (0, 1, "10.0.0.5:8000", "10.0.0.5:8000#1")
    assert (rank0.metrics.waiting, rank1.metrics.waiting) == (1.0, 6.0)
    assert pool.get("10.0.0.5:8000#1") is rank1 and pool.get("10.0.0.5:8000") is server
    assert pool.all() == [server, other]  # what is scraped: the servers
    # A rank's in-flight count is its own; its server's is the sum (the scraper's comparison with the page)
    rank1.start_request(10, 0.0)
    assert (rank0.in_flight, rank1.in_flight, server.in_flight) == (0, 1, 1)
    rank1.finish_request(10)
    assert server.in_flight == 0
    # Health is the server's: its ranks follow, each told
    events.clear()
    pool.mark_unready(server, "gone")
    assert [e.address for e in pool.ready()] == ["10.0.0.6:8000"] and not rank0.healthy
    assert events == [("unready", "10.0.0.5:8000#0"), ("unready", "10.0.0.5:8000#1")]
    pool.mark_ready(server)
    events.clear()
    pool.mark_restarted(server, "counters went down")
    assert events == [("restarted", "10.0.0.5:8000#0"), ("restarted", "10.0.0.5:8000#1")]


def test_a_server_restarted_with_another_data_parallel_size_is_reranked() -> None:
    pool = EndpointPool()
    server = Endpoint.from_address("10.0.0.5:8000")
    pool.set_endpoints([server])
    scraped(pool, server, dp_page({0: 0.0, 1: 0.0}))
    kept = pool.ranks(server)[1]
    events = watched(pool)
    scraped(pool, server, dp_page({0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}))
    assert [r.rank for r in pool.ranks(server)] == [0, 1, 2, 3] and pool.ranks(server)[1] is kept
    assert events == [("added", "10.0.0.5:8000#2"), ("added", "10.0.0.5:8000#3")]
    events.clear()
    scraped(pool, server, IDLE)  # one engine again: the server is routed as one
    assert pool.ranks(server) == () and pool.ready() == [server] and pool.get("10.0.0.5:8000#1") is None
    assert events == [("removed", f"10.0.0.5:8000#{r}") for r in range(4)] + [("added", "10.0.0.5:8000")]
    events.clear()
    scraped(pool, server, dp_page({0: 0.0, 1: 0.0}))
    pool.set_endpoints([])  # the server leaves: its ranks, then itself
    assert events[-3:] == [("removed", "10.0.0.5:8000#0"), ("removed", "10.0.0.5:8000#1"),
                           ("removed", "10.0.0.5:8000")]
    assert pool.get("10.0.0.5:8000#0") is None and pool.targets() == []


def test_a_configured_count_splits_every_server_from_the_start_and_shares_an_unlabelled_page() -> None:
    pool = EndpointPool(ranks=2)
    server = Endpoint.from_address("10.0.0.5:8000")
    events = watched(pool)
    pool.set_endpoints([server])
    assert events == [("added", "10.0.0.5:8000#0"), ("added", "10.0.0.5:8000#1")]
    server.metrics = EndpointMetrics(waiting=4.0, running=2.0, kv_usage=0.5, block_size=16, num_gpu_blocks=100,
                                     updated_at=1.0)
    pool.metrics_read(server)
    rank = pool.ranks(server)[1]
    assert (rank.metrics.waiting, rank.metrics.running, rank.metrics.kv_usage, rank.metrics.num_gpu_blocks) \
        == (2.0, 1.0, 0.5, 50)
    scraped(pool, server, dp_page({0: 3.0, 1: 9.0}))  # a page that labels them: each its own
    assert rank.metrics.waiting == 9.0 and len(events) == 2
    assert EndpointPool(ranks=1).configured_ranks == 1  # 1: never split
    pool1 = EndpointPool(ranks=1)
    pool1.set_endpoints([single := Endpoint.from_address("10.0.0.7:8000")])
    scraped(pool1, single, dp_page({0: 3.0, 1: 9.0}))
    assert pool1.ready() == [single]


def resolved(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    return resolve(parser.parse_args(["--endpoints", "127.0.0.1:8000", *argv]))


@pytest.mark.timeout(30)  # a value that wrongly passes would start serving
@pytest.mark.parametrize("text", ["data-parallel-ranks: -1", "data-parallel-ranks: many", "data_parallel_ranks: 2.5"])
def test_the_data_parallel_rank_count_is_decoded_strictly(capsys: pytest.CaptureFixture[str], text: str) -> None:
    assert resolved("--config-text", "data-parallel-ranks: 8").data_parallel_ranks == 8
    assert resolved("--data-parallel-ranks", "2").data_parallel_ranks == 2
    assert main(["serve", "--endpoints", "127.0.0.1:8000", "--config-text", text]) == 2
    err = capsys.readouterr().err
    assert re.search(r"data.parallel.ranks", err) and "Traceback" not in err, err


def decision_for(endpoint: Endpoint, headers: dict[str, str]) -> Decision:
    request = InferenceRequest(request_id="r", model="tiny", path="/v1/completions", headers=headers)
    return Decision(request, [endpoint], endpoint.destination, None, 1, 0.0)


def test_the_rank_is_carried_in_the_header_and_a_clients_is_removed() -> None:
    server = Endpoint.from_address("10.0.0.5:8000")
    plugin = DataParallelRank()
    rank = Endpoint.rank_of(server, 1)
    to_rank = decision_for(rank, {names.DATA_PARALLEL_RANK: "0"})
    plugin.placed(to_rank, b"")
    assert to_rank.destination == "10.0.0.5:8000" and to_rank.set_headers == {names.DATA_PARALLEL_RANK: "1"}
    assert to_rank.removed_headers == ()  # overwritten, not removed
    whole = decision_for(server, {names.DATA_PARALLEL_RANK: "3"})
    plugin.placed(whole, b"")
    assert whole.set_headers is None and whole.removed_headers == (names.DATA_PARALLEL_RANK,)
    untouched = decision_for(server, {})
    plugin.placed(untouched, b"")
    assert untouched.set_headers is None and untouched.removed_headers == ()  # nothing asked of a locked gateway


def test_shared_scrape_records_carry_the_engines() -> None:
    m = parse_metrics(dp_page({0: 2.0, 1: 5.0}), updated_at=1.0)
    back = _decode(_encode(SharedSample("r", 1.0, 0.5, m))).metrics
    assert back is not None and back.engines is not None and back.engines[1].waiting == 5.0
    assert _decode(_encode(SharedSample("r", 1.0, 0.5, parse_metrics(IDLE)))).metrics.engines is None  # type: ignore[union-attr]


def test_each_rank_is_scored_on_its_own_prefix_entries_and_load() -> None:
    """The scheduler sees ranks as it sees pods: a prompt learnt on rank 1 matches rank 1 only."""
    pool = EndpointPool()
    server = Endpoint.from_address("10.0.0.5:8000")
    pool.set_endpoints([server])
    scraped(pool, server, dp_page({0: 0.0, 1: 0.0}))
    scheduler = build_scheduler(rng=random.Random(0))
    pool.subscribe(lambda event, e: scheduler.on_endpoint_removed(e) if event is PoolEvent.REMOVED else None)
    prompt = "a long shared system prompt " * 40
    request = InferenceRequest(request_id="a", model="tiny", api=ApiKind.COMPLETIONS, path="/v1/completions",
                               prompt_text=prompt)
    first = scheduler.schedule(request, pool.ready(), 0.0)
    assert first.context is not None
    chosen = first.ranked[0]
    scheduler.on_picked(first.context, chosen, 0.0)
    again = scheduler.schedule(InferenceRequest(request_id="b", model="tiny", api=ApiKind.COMPLETIONS,
                                                path="/v1/completions", prompt_text=prompt + " and more"),
                               pool.ready(), 0.1)
    assert again.ranked[0] is chosen and chosen.rank in (0, 1)
