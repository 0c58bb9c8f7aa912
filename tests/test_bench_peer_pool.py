"""A pool change reaches a peer router through its own add/remove-worker API (sglang-router: /workers and
DELETE /workers/{id}; vllm-router: /add_worker and /remove_worker), here against a fake of both admin APIs
with the shapes the real routers answer with."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from picker_lab.bench.peers import PEERS, PeerPool


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


def test_router_names_carry_their_replicas_and_the_mesh() -> None:
    from picker_lab.bench.peers import is_peer, replicated

    assert replicated("smg") == ("smg", 1, False)
    assert replicated("smg@4") == ("smg", 4, False)
    assert replicated("smg-mesh@4") == ("smg", 4, True)
    assert replicated("picker@2") == ("picker", 2, False)
    assert is_peer("sglang-router@2") and is_peer("smg-mesh@2") and not is_peer("picker@2")
    for bad in ("smg@0", "smg@x", "vllm-router-mesh@2"):
        with pytest.raises(ValueError):
            replicated(bad)


def test_smg_replicas_join_each_others_mesh() -> None:
    from pathlib import Path

    from picker_lab.bench.peers import command

    smg = PEERS["smg"]
    first = command(smg, Path("smg"), 8001, 9001, ["http://127.0.0.1:7000"], (5001, []))
    third = command(smg, Path("smg"), 8003, 9003, ["http://127.0.0.1:7000"], (5003, [5001, 5002]))
    assert first[:2] == ["smg", "launch"] and "--mesh-peer-urls" not in first and "--enable-mesh" in first
    assert third[third.index("--mesh-port") + 1] == "5003"
    assert third[third.index("--mesh-peer-urls") + 1:] == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert third[third.index("--policy") + 1] == "cache_aware"
    alone = command(PEERS["vllm-router"], Path("vllm-router"), 8004, 9004, ["http://127.0.0.1:7000"])
    assert alone[1] != "launch" and "--enable-mesh" not in alone
