"""Echo backends: tiny OpenAI-style servers for wiring checks, tests and overhead benchmarks. Each answers with its own address and what it received,
so a test can tell which pod served a request and whether the body arrived intact.

Run several in one process: `python -m picker.echo 127.0.0.1:8001 127.0.0.1:8002`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from aiohttp import web


def make_app(address: str) -> web.Application:
    stats = {"requests": 0}

    async def inference(request: web.Request) -> web.StreamResponse:
        stats["requests"] += 1
        body = await request.read()
        info = {
            "served_by": address,
            "path": request.path,
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "destination_header": request.headers.get("x-gateway-destination-endpoint"),
            "request_id": request.headers.get("x-request-id"),
        }
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {}
        if isinstance(data, dict) and data.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            delay = float(data.get("test_event_delay", 0.0))
            for i in range(int(data.get("test_events", 3))):
                await response.write(f"data: {json.dumps({**info, 'event': i})}\n\n".encode())
                await asyncio.sleep(delay)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(info)

    async def models(request: web.Request) -> web.Response:
        stats["requests"] += 1
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}],
                                  "served_by": address})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=(
            "vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0\n"
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0\n"
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.0\n"))

    async def count(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/test/count", count)
    app.router.add_route("*", "/{tail:.*}", inference)
    return app


async def serve(addresses: list[str]) -> None:
    runners = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        runner = web.AppRunner(make_app(address), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, int(port)).start()
        runners.append(runner)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1:]))
