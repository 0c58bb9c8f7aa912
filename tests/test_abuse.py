"""What an outsider on the network can do to the picker, through real Envoy: grow /metrics and memory with made-up
model names (refused, 404, and counted under one label), break /metrics with one request, ... Each must stay bounded."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.conftest import Stack


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_ten_thousand_made_up_model_names_leave_metrics_and_memory_bounded(stack: Stack) -> None:
    envoy, metrics_url = stack.envoys["buffered"], f"http://127.0.0.1:{stack.picker.metrics_port}/metrics"
    pid = stack.picker.process.proc.pid
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:

        async def send(i: int) -> int:
            body = json.dumps({"model": f"made-up-{i}", "prompt": "p"}).encode()
            async with session.post(envoy.url + "/v1/completions", data=body) as response:
                await response.read()
                return response.status

        await asyncio.gather(*(send(i) for i in range(200)))  # warm: allocator arenas, caches, connections
        before = rss_bytes(pid)
        statuses: list[int] = []
        for start in range(0, 10_000, 500):
            statuses += await asyncio.gather(*(send(i) for i in range(start, start + 500)))
        assert statuses.count(404) == 10_000  # model_not_found from the picker: no pod serves them
        async with session.get(metrics_url) as response:
            assert response.status == 200
            text = await response.text()
    assert len(text.encode()) < 100_000, len(text)
    assert "made-up-" not in text and 'model_name="other"' in text
    assert rss_bytes(pid) - before < 20 * 2**20, (before, rss_bytes(pid))
    stack.check_alive()
