"""Decision spans reach an OTLP/HTTP (JSON) collector endpoint: a collector stand-in on loopback."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from picker_lab.supervisor import HOST, free_port, process_scope, start_backends, start_picker
from tests.test_extproc_grpc import body_msg, exchange, headers_msg


def _value(v: dict[str, Any]) -> object:
    return v.get("stringValue", v.get("intValue", v.get("doubleValue")))


async def test_each_decision_is_a_span() -> None:
    spans: list[dict[str, object]] = []

    async def receive(request: web.Request) -> web.Response:
        assert request.content_type == "application/json"
        payload = await request.json()
        for resource in payload["resourceSpans"]:
            service = {a["key"]: _value(a["value"]) for a in resource["resource"]["attributes"]}["service.name"]
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    assert len(span["traceId"]) == 32 and int(span["endTimeUnixNano"]) >= int(span["startTimeUnixNano"])
                    attrs = {a["key"]: _value(a["value"]) for a in span["attributes"]}
                    spans.append({"name": span["name"], "service": service, **attrs})
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    try:
        with process_scope("tracing") as (logdir, started):
            backends = start_backends(2, logdir)
            started.append(backends.process)
            picker = start_picker(logdir, endpoints=backends.addresses,
                                  extra=["--otlp-endpoint", f"http://{HOST}:{port}"])
            started.append(picker.process)
            body = json.dumps({"model": "tiny", "prompt": "trace me"}).encode()
            await exchange(picker.grpc_port, [headers_msg("/v1/completions", extra={"x-request-id": "span-1"}),
                                              body_msg(body)])
            await exchange(picker.grpc_port, [headers_msg(extra={"x-request-id": "span-2"}), body_msg(b"{")])
            for _ in range(100):
                if len(spans) >= 2:
                    break
                await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
    by_id = {s["picker.request_id"]: s for s in spans}
    assert by_id["span-1"]["name"] == "picker.route" and by_id["span-1"]["service"] == "picker"
    assert by_id["span-1"]["picker.destination"] in backends.addresses
    assert by_id["span-1"]["gen_ai.request.model"] == "tiny"
    assert by_id["span-2"]["picker.error.code"] == "invalid_json"
    assert by_id["span-2"]["picker.error.status"] == "400"
