"""What an outsider on the network can do to the picker, through real Envoy: grow /metrics and memory with made-up
model names (refused, 404, and counted under one label), break /metrics with one request, ... Each must stay bounded."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.conftest import Stack


async def test_ten_thousand_made_up_model_names_leave_metrics_and_memory_bounded(stack: Stack) -> None:
    envoy, metrics_url = stack.envoys["buffered"], f"http://127.0.0.1:{stack.picker.metrics_port}/metrics"
    picker = stack.picker.process
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:

        async def send(i: int) -> int:
            body = json.dumps({"model": f"made-up-{i}", "prompt": "p"}).encode()
            async with session.post(envoy.url + "/v1/completions", data=body) as response:
                await response.read()
                return response.status

        await asyncio.gather(*(send(i) for i in range(200)))  # warm: allocator arenas, caches, connections
        before = picker.rss_bytes()
        statuses: list[int] = []
        for start in range(0, 10_000, 500):
            statuses += await asyncio.gather(*(send(i) for i in range(start, start + 500)))
        assert statuses.count(404) == 10_000  # model_not_found from the picker: no pod serves them
        async with session.get(metrics_url) as response:
            assert response.status == 200
            text = await response.text()
    assert len(text.encode()) < 100_000, len(text)
    assert "made-up-" not in text and 'model_name="other"' in text
    assert picker.rss_bytes() - before < 20 * 2**20, (before, picker.rss_bytes())
    stack.check_alive()
