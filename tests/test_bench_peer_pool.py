"""A pool change reaches a peer router through its own add/remove-worker API (sglang-router: /workers and
DELETE /workers/{id}; vllm-router: /add_worker and /remove_worker), here against a fake of both admin APIs
with the shapes the real routers answer with."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from picker.bench.peers import PEERS, PeerPool


class FakeAdmin:
    """Both peers' admin APIs over one worker list; `calls` records (method, path)."""

    def __init__(self, urls: list[str]) -> None:
        self.workers = {str(uuid.uuid4()): url for url in urls}
        self.calls: list[tuple[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.record])
        app.router.add_get("/workers", self.list_workers)
        app.router.add_post("/workers", self.post_worker)
        app.router.add_delete("/workers/{id}", self.delete_worker)
        app.router.add_post("/add_worker", self.add_by_query)
        app.router.add_post("/remove_worker", self.remove_by_query)
        return app

    @web.middleware
    async def record(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        self.calls.append((request.method, request.path))
        return await handler(request)

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [{"id": i, "url": u, "is_healthy": True} for i, u in self.workers.items()]})

    async def post_worker(self, request: web.Request) -> web.Response:
        worker_id = str(uuid.uuid4())
        self.workers[worker_id] = (await request.json())["url"]
        return web.json_response({"status": "accepted", "worker_id": worker_id}, status=202)

    async def delete_worker(self, request: web.Request) -> web.Response:
        if self.workers.pop(request.match_info["id"], None) is None:
            return web.json_response({"error": "no such worker"}, status=404)
        return web.json_response({"status": "accepted"}, status=202)

    async def add_by_query(self, request: web.Request) -> web.Response:
        self.workers[str(uuid.uuid4())] = request.query["url"]
        return web.Response(text=f"Successfully added worker: {request.query['url']}")

    async def remove_by_query(self, request: web.Request) -> web.Response:
        ids = [i for i, u in self.workers.items() if u == request.query["url"]]
        if not ids:
            return web.Response(text="Worker not found", status=400)
        del self.workers[ids[0]]
        return web.Response(text="Successfully removed worker")


@pytest.fixture
async def admin() -> AsyncIterator[tuple[FakeAdmin, str]]:
    fake = FakeAdmin(["http://127.0.0.1:1001", "http://127.0.0.1:1002"])
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.parametrize(("name", "adds", "removes"), [
    ("sglang-router", ("POST", "/workers"), ("DELETE", "/workers/")),
    ("vllm-router", ("POST", "/add_worker"), ("POST", "/remove_worker")),
])
async def test_a_leave_and_a_join_reach_the_peer_through_its_api(
        admin: tuple[FakeAdmin, str], name: str, adds: tuple[str, str], removes: tuple[str, str]) -> None:
    fake, base = admin
    pool = PeerPool(PEERS[name], base, ["127.0.0.1:1001", "127.0.0.1:1002"])
    await asyncio.to_thread(pool, ["127.0.0.1:1001"])
    assert set(fake.workers.values()) == {"http://127.0.0.1:1001"}
    assert any(m == removes[0] and p.startswith(removes[1]) for m, p in fake.calls)
    fake.calls.clear()
    await asyncio.to_thread(pool, ["127.0.0.1:1001", "127.0.0.1:1003"])
    assert set(fake.workers.values()) == {"http://127.0.0.1:1001", "http://127.0.0.1:1003"}
    assert fake.calls[-1] == adds and pool.addresses == ["127.0.0.1:1001", "127.0.0.1:1003"]
    await asyncio.to_thread(pool, ["127.0.0.1:1001", "127.0.0.1:1003"])  # nothing changed: no call
    assert fake.calls[-1] == adds


async def test_a_worker_the_peer_does_not_know_is_a_clear_error(admin: tuple[FakeAdmin, str]) -> None:
    fake, base = admin
    for name in PEERS:
        pool = PeerPool(PEERS[name], base, ["127.0.0.1:1009"])
        with pytest.raises(RuntimeError, match="127.0.0.1:1009"):
            await asyncio.to_thread(pool, [])
