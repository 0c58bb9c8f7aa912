"""Behind a gateway that lets its external processor touch only named headers, every request is routed, in both
body modes: the picker sets or removes only what a feature in use needs (picker/core/headers.py), and never
removes a header the request does not carry (Envoy refuses that as any other mutation).

The rules are an operator's, not the templates': exactly the destination, content-type and content-length
(`disallow_all`, `disallow_is_error`: any other mutation fails the request with a 500)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from picker.core.headers import MODEL_REWRITE, MUTATED, PREFILLER, REQUEST_ID, mutated_names
from picker.serving.envoyconfig import EnvoySettings, render
from picker.tools import doctor
from picker_lab.supervisor import HOST, Envoy, process_scope, start_envoy
from tests.conftest import Stack

OPERATOR_RULES = {"disallow_all": True, "disallow_is_error": True,
                  "allow_expression": {"regex": "^(x-gateway-destination-endpoint|content-type|content-length)$"}}


def ext_proc_filter(config: dict[str, Any]) -> dict[str, Any]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    found: dict[str, Any] = next(f["typed_config"] for f in manager["http_filters"]
                                 if f["name"] == "envoy.filters.http.ext_proc")
    return found


def operator_rules(config: dict[str, Any]) -> None:
    ext_proc_filter(config)["mutation_rules"] = OPERATOR_RULES


def no_lengths(config: dict[str, Any]) -> None:
    """An operator who forgot content-length: the picker's rewritten bodies cannot be sent."""
    operator_rules(config)
    ext_proc_filter(config)["mutation_rules"]["allow_expression"]["regex"] = \
        "^(x-gateway-destination-endpoint|content-type)$"


def no_request_ids(config: dict[str, Any]) -> None:
    """Envoy generates no x-request-id: the picker sets its own, which the rules must then allow."""
    operator_rules(config)
    ext_proc_filter(config)["mutation_rules"]["allow_expression"]["regex"] = \
        "^(x-gateway-destination-endpoint|content-type|content-length|x-request-id)$"
    config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "generate_request_id"] = False


@pytest.fixture(scope="module")
def locked(stack: Stack) -> Iterator[dict[str, Envoy]]:
    with process_scope("locked-down") as (logdir, started):
        envoys = {}
        for mode in ("buffered", "full-duplex"):
            for name, edit in (("operator", operator_rules), ("no-ids", no_request_ids), ("no-lengths", no_lengths)):
                envoy = start_envoy(logdir, stack.picker, stack.backends.addresses, mode=mode,
                                    name=f"envoy-{name}-{mode}", edit=edit)
                started.append(envoy.process)
                envoys[f"{name}-{mode}"] = envoy
        yield envoys


async def post(envoy: Envoy, payload: dict[str, object], headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            envoy.url + "/v1/chat/completions", data=json.dumps(payload).encode(), headers=headers or {}) as response:
        return response.status, json.loads(await response.read())


def chat(text: str, model: str = "tiny") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_every_request_is_routed_behind_an_operators_rules(locked: dict[str, Envoy], stack: Stack,
                                                                 mode: str) -> None:
    envoy = locked[f"operator-{mode}"]
    for i in range(4):
        status, body = await post(envoy, chat(f"locked {mode} {i}"))
        assert status == 200, body
        assert body["destination_header"] == body["served_by"] in stack.backends.addresses
    # P/D is not configured: a client's x-prefiller-host-port is none of the picker's business (left as it came)
    status, body = await post(envoy, chat(f"prefiller {mode}"), {PREFILLER: "10.0.0.1:8000"})
    assert status == 200, body
    assert body["prefiller_header"] == "10.0.0.1:8000"
    # the gateway names another model: the body is rewritten, its content-length set (allowed), still routed
    status, body = await post(envoy, chat(f"rewrite {mode}", model="someone-elses"), {MODEL_REWRITE: "tiny"})
    assert status == 200, body
    # the pod read the rewritten body whole; its answer names the client's model where the picker sees the response
    assert body["model"] == ("someone-elses" if mode == "full-duplex" else "tiny")
    # the picker's own answers carry only content-type: a refusal reaches the client as the picker wrote it
    status, body = await post(envoy, {"model": "tiny"})
    assert status == 400 and body["error"]["type"] == "picker_error", body
    async with aiohttp.ClientSession() as session, session.get(envoy.url + "/v1/models") as response:
        assert response.status == 200 and (await response.json())["object"] == "list"
    # a header of an answer the rules refuse is dropped by Envoy; the status and the body stay the picker's
    async with aiohttp.ClientSession() as session, session.get(envoy.url + "/v1/chat/completions") as response:
        assert response.status == 405 and "allow" not in response.headers
        assert (await response.json())["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_a_request_id_the_picker_generates_needs_its_header_allowed(locked: dict[str, Envoy], mode: str
                                                                         ) -> None:
    status, body = await post(locked[f"no-ids-{mode}"], chat(f"no id {mode}"))
    assert status == 200, body
    assert body["request_id"] and len(body["request_id"]) == 32  # the picker's uuid4 hex: Envoy made none


def test_the_docs_list_exactly_the_headers_the_picker_may_touch() -> None:
    assert REQUEST_ID in mutated_names(disaggregation=False)
    assert PREFILLER not in mutated_names(disaggregation=False)
    assert PREFILLER in mutated_names(disaggregation=True)
    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    section = text[text.index("### Headers the picker sets or removes"):]
    table = section[:section.index("\n\n", section.index("| header |"))]
    listed = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert listed == [h.name for h in MUTATED]
    rendered = render(EnvoySettings(disaggregation=True))
    assert f'regex: "{"|".join(h.name for h in MUTATED)}"' in rendered


async def test_doctor_names_a_header_change_the_gateway_refused(locked: dict[str, Envoy]) -> None:
    envoy = locked["no-lengths-buffered"]
    status, body = await post(envoy, chat("short"))
    assert status == 200, body  # nothing the rules refuse
    assert doctor.diagnose(doctor.read(f"http://{HOST}:{envoy.admin_port}")) == []
    async with aiohttp.ClientSession() as session, session.post(
            envoy.url + "/v1/chat/completions", data=json.dumps(chat("rewritten", model="someone-elses")).encode(),
            headers={MODEL_REWRITE: "tiny"}) as response:
        assert response.status == 500  # Envoy's answer to a refused mutation with disallow_is_error
    problems = doctor.diagnose(doctor.read(f"http://{HOST}:{envoy.admin_port}"))
    assert len(problems) == 1 and "refused 1 header change of the picker" in problems[0] and "mutation_rules" in problems[0]

