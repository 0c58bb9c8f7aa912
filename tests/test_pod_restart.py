"""A model server that restarts between two scrapes (never seen unready) comes back with an empty cache: a counter
of its going down tells the scraper, the pool says so once, and the director forgets what it had recorded there."""

from __future__ import annotations

import json

from picker.core.requests import build_request
from picker.endpoints.pool import EndpointPool
from picker.endpoints.scraper import MetricsScraper, started_over
from picker.endpoints.state import Endpoint, EndpointMetrics, EndpointState
from picker.routing.director import Director
from picker.scheduling.config import build_strategy
from tests.fake_pod import running_pods

SYSTEM = "You are the runbook assistant of a large platform; answer briefly and cite the section. " * 8


def test_a_counter_going_down_in_a_later_reading_is_a_restart() -> None:
    before = EndpointMetrics(prefix_queries=500.0, prompt_count=9.0, updated_at=10.0)
    assert started_over(before, EndpointMetrics(prefix_queries=600.0, prompt_count=9.0, updated_at=11.0)) == ""
    assert "prefix cache queries went from 500 to 71" in started_over(
        before, EndpointMetrics(prefix_queries=71.0, prompt_count=9.0, updated_at=11.0))
    assert started_over(before, EndpointMetrics(prefix_queries=71.0, updated_at=9.0)) == ""  # an older record
    assert started_over(EndpointMetrics(), EndpointMetrics(prefix_queries=1.0, updated_at=1.0)) == ""  # first look


async def test_the_scraper_reports_a_restart_once_and_the_pod_stays_ready() -> None:
    async with running_pods(1) as (pod,):
        pool = EndpointPool()
        pool.set_endpoints([pod.endpoint])
        events: list[str] = []
        pool.subscribe(lambda event, e: events.append(event.value))
        now = [100.0]
        scraper = MetricsScraper(pool.all, health=pool, clock=lambda: now[0])
        try:
            pod.queries = 500
            await scraper.poll_once()
            now[0] += 1
            pod.queries = 0  # the page's own engine-0 series stays: its sum goes down, as after a restart
            await scraper.poll_once()
            now[0] += 1
            await scraper.poll_once()
        finally:
            await scraper.stop()
        assert events == ["restarted"] and pod.endpoint.state is EndpointState.READY


def test_the_director_forgets_a_restarted_pods_cache() -> None:
    pool = EndpointPool()
    pool.set_endpoints([Endpoint.from_address("10.0.0.1:8000"), Endpoint.from_address("10.0.0.2:8000")])
    director = Director(pool, build_strategy("picker"))

    def ask(i: int) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": f"question {i}"}]}).encode()

    headers = {":path": "/v1/chat/completions", ":method": "POST"}
    decision = director.place(build_request(headers, ask(1), request_id="1"), 1.0)
    held = director.rank(build_request(headers, ask(2), request_id="2"), 2.0)
    assert held.ranked[0] is decision.endpoint and held.prefix_matched_blocks > 0
    pool.mark_restarted(decision.endpoint, "its counters went down")
    after = director.rank(build_request(headers, ask(3), request_id="3"), 3.0)
    assert after.prefix_matched_blocks == 0
