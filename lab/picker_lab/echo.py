"""Echo backends: tiny OpenAI-style servers for wiring checks, tests and overhead benchmarks. Each answers with its own address and what it received,
so a test can tell which pod served a request and whether the body arrived intact.

Run several in one process: `python -m picker_lab.echo 127.0.0.1:8001 127.0.0.1:8002`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from typing import Any

from aiohttp import web

from picker.core import headers as names
from picker.endpoints.metrics import only_named_samples


def make_app(address: str) -> web.Application:
    stats = {"requests": 0, "listings": 0, "metrics_pages": 0, "filtered_metrics_pages": 0}

    async def inference(request: web.Request) -> web.StreamResponse:
        stats["requests"] += 1
        body = await request.read()
        info = {
            "served_by": address,
            "path": request.path,
            "body_bytes": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "destination_header": request.headers.get(names.DESTINATION),
            "request_id": request.headers.get(names.REQUEST_ID),
            "prefiller_header": request.headers.get(names.PREFILLER),
        }
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {}
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            info["model"] = data["model"]  # as vLLM names the model it served (a picker may rename it back)
            info["received_model"] = data["model"]  # what the pod was asked for, left alone
        # Usage as vLLM reports it, so token accounting downstream can be checked.
        usage = {"prompt_tokens": len(body) // 4, "completion_tokens": 3,
                 "prompt_tokens_details": {"cached_tokens": len(body) // 8}}
        info["usage"] = usage
        if request.path.endswith("/messages"):  # Anthropic's Messages API, as vLLM serves it
            return await _anthropic_reply(request, info, usage, bool(isinstance(data, dict) and data.get("stream")))
        if isinstance(data, dict) and data.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            delay = float(data.get("test_event_delay", 0.0))
            for i in range(int(data.get("test_events", 3))):
                await response.write(f"data: {json.dumps({**info, 'event': i})}\n\n".encode())
                await asyncio.sleep(delay)
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(info)

    async def models(request: web.Request) -> web.Response:
        stats["listings"] += 1  # not a request: pickers read it on a timer
        listed = [{"id": m, "object": "model", "parent": None} for m in state["models"]]
        listed += [{"id": a, "object": "model", "parent": state["models"][0]} for a in state["adapters"]]
        return web.json_response({"object": "list", "data": listed, "served_by": address})

    # What /metrics reports, in vLLM 0.32 names; tests set it with POST /test/metrics.
    state: dict[str, Any] = {"waiting": 0, "running": 0, "kv": 0.0, "block_size": 16, "num_gpu_blocks": 4096,
                             "max_lora": 4, "running_loras": [], "waiting_loras": [], "down": False,
                             "models": ["tiny"], "engine": "vllm",  # engine "sglang": SGLang's metric names
                             "adapters": []}  # adapters: loaded (listed at /v1/models), not running

    async def metrics(request: web.Request) -> web.Response:
        """The engine's page; at `/metrics/` with `name[]` only the samples named (as vLLM's exporter answers)."""
        if state["down"]:
            return web.Response(status=503, text="down")
        page = metrics_page()
        if request.path.endswith("/"):
            stats["filtered_metrics_pages"] += 1
            page = only_named_samples(page, request.query.getall("name[]", []))
        else:
            stats["metrics_pages"] += 1
        return web.Response(text=page)

    def metrics_page() -> str:
        if state["engine"] == "sglang":
            labels = f'model_name="{state["models"][0]}"'
            return (
                f"sglang:num_running_reqs{{{labels}}} {float(state['running'])}\n"
                f"sglang:num_queue_reqs{{{labels}}} {float(state['waiting'])}\n"
                f"sglang:token_usage{{{labels}}} {float(state['kv'])}\n")
        labels = f'engine="0",model_name="{state["models"][0]}"'
        more = "".join(f'vllm:num_requests_running{{engine="{i}",model_name="{m}"}} 0.0\n'
                       for i, m in enumerate(state["models"][1:], start=1))  # an engine per further model
        return (
            f"vllm:num_requests_running{{{labels}}} {float(state['running'])}\n{more}"
            f"vllm:num_requests_waiting{{{labels}}} {float(state['waiting'])}\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(state['kv'])}\n"
            f'vllm:cache_config_info{{block_size="{state["block_size"]}",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{state["num_gpu_blocks"]}"}} 1.0\n'
            f'vllm:lora_requests_info{{max_lora="{state["max_lora"]}",'
            f'running_lora_adapters="{",".join(state["running_loras"])}",'
            f'waiting_lora_adapters="{",".join(state["waiting_loras"])}"}} {time.time()}\n')

    async def set_metrics(request: web.Request) -> web.Response:
        update = await request.json()
        unknown = set(update) - set(state)
        if unknown:
            return web.json_response({"error": f"unknown fields {sorted(unknown)}"}, status=400)
        state.update(update)
        return web.json_response(state)

    async def count(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/", metrics)
    app.router.add_get("/test/count", count)
    app.router.add_post("/test/metrics", set_metrics)
    app.router.add_route("*", "/{tail:.*}", inference)
    return app


async def _anthropic_reply(request: web.Request, info: dict[str, Any], usage: dict[str, Any],
                           stream: bool) -> web.StreamResponse:
    """The reply in Anthropic's shape, usage as vLLM writes it: `input_tokens` without the cached ones."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    anthropic = {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
                 "cache_read_input_tokens": cached}
    message = {**info, "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    if not stream:
        return web.json_response({**message, "usage": anthropic})
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    events = [("message_start", {"type": "message_start", "message": {**message, "content": [],
                                                                      "usage": {**anthropic, "output_tokens": 1}}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": "hi"}}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                 "usage": {"output_tokens": anthropic["output_tokens"]}}),
              ("message_stop", {"type": "message_stop"})]
    for name, event in events:
        await response.write(f"event: {name}\ndata: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


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
