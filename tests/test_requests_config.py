"""Request parsing, option parsing and endpoint sources: the pure pieces under the ext_proc servicer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from picker.core.requests import (
    ApiKind,
    InferenceRequest,
    RequestError,
    api_kind_for_path,
    build_request,
    render_messages,
)
from picker.endpoints.discovery import (
    EndpointsFileWatcher,
    StaticEndpoints,
    load_endpoints_file,
    parse_endpoint_list,
    resolve_name,
)
from picker.endpoints.pool import EndpointPool, PoolEvent
from picker.serving import config as cfg


@pytest.mark.parametrize("path,kind", [
    ("/v1/chat/completions", ApiKind.CHAT), ("/v1/completions?x=1", ApiKind.COMPLETIONS),
    ("/v1/responses", ApiKind.RESPONSES), ("/v1/embeddings/", ApiKind.EMBEDDINGS),
    ("/v1/conversations", ApiKind.CONVERSATIONS), ("/v1/models", None), ("/", None),
    ("/v1/messages", ApiKind.MESSAGES),
])
def test_api_kind_for_path(path: str, kind: ApiKind | None) -> None:
    assert api_kind_for_path(path) is kind


def test_anthropic_messages_share_prefixes_like_chat() -> None:
    """/v1/messages (Anthropic's API, which vLLM serves): the system prompt, then the turns, as text blocks or
    strings; a later turn of the same conversation extends the earlier one's text."""
    system = [{"type": "text", "text": "You are a careful assistant. " * 20}]
    turn: list[dict[str, object]] = [{"role": "user", "content": "q1"}]
    first = {"model": "m", "max_tokens": 16, "system": system, "messages": turn}
    later = {**first, "messages": [*turn, {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
                                   {"role": "user", "content": "q2"}]}
    headers = {":path": "/v1/messages", ":method": "POST"}
    a = build_request(headers, json.dumps(first).encode(), request_id="a")
    b = build_request(headers, json.dumps(later).encode(), request_id="b")
    assert a.api is ApiKind.MESSAGES and a.prompt_text.startswith("<|system|>\nYou are a careful assistant.")
    assert b.prompt_text.startswith(a.prompt_text.removesuffix("<|end|>\n")) and len(b.prompt_text) > len(a.prompt_text)
    with pytest.raises(RequestError) as missing:
        build_request(headers, b'{"model": "m", "max_tokens": 1}', request_id="c")
    assert missing.value.code == "missing_messages"


def test_chat_rendering_is_prefix_stable() -> None:
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    longer = [*first, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert render_messages(longer).startswith(render_messages(first))
    multipart = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "ab" in render_messages(multipart)


def test_build_request_reads_headers_and_body() -> None:
    body = json.dumps({"model": "m", "prompt": "p" * 40, "max_tokens": 7, "stream": True,
                       "cache_salt": "s"}).encode()
    request = build_request({":path": "/v1/completions", "x-gateway-inference-objective": "batch",
                             "x-session-id": "abc"}, body, request_id="r")
    assert (request.model, request.max_tokens, request.stream, request.cache_salt) == ("m", 7, True, "s")
    assert (request.objective, request.session_id, request.prompt_text) == ("batch", "abc", "p" * 40)


@pytest.mark.parametrize("body,code", [
    (b"", "empty_body"), (b"\xff", "invalid_utf8"), (b"{", "invalid_json"), (b"3", "invalid_json"),
    (b'{"model": 3, "prompt": "x"}', "missing_model"), (b'{"model": "m"}', "missing_prompt"),
    (b'{"model": "m", "prompt": {"a": 1}}', "invalid_prompt"),
])
def test_bad_bodies(body: bytes, code: str) -> None:
    with pytest.raises(RequestError) as info:
        build_request({":path": "/v1/completions"}, body, request_id="r")
    assert info.value.status == 400 and info.value.code == code


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b"[" * 100_000),
    ("/v1/completions", b'{"a": ' * 100_000),
    ("/v1/completions", b'{"model": "m", "prompt": [1, ' + b"[" * 100_000 + b"]}"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": {"a": '
     + b"[" * 5_000 + b"]" * 5_000 + b"}}]}"),
])
def test_deeply_nested_bodies_are_invalid_json(path: str, body: bytes) -> None:
    # Python's JSON decoder recurses per level: the client gets a 400, not a RecursionError that ends the stream.
    with pytest.raises(RequestError) as info:
        build_request({":path": path}, body, request_id="r")
    assert (info.value.status, info.value.code, info.value.message) == (
        400, "invalid_json", "request body is nested too deeply")


def test_durations_and_sizes() -> None:
    assert cfg.parse_duration("50ms") == pytest.approx(0.05)
    assert cfg.parse_duration("2m") == 120 and cfg.parse_duration(0.5) == 0.5  # YAML numbers are seconds
    assert cfg.parse_duration("0") == 0.0
    with pytest.raises(ValueError, match="needs a unit: 50ms or 50s"):
        cfg.parse_duration("50")  # a flag value without a unit is ambiguous
    assert cfg.parse_size("16Mi") == 16 * 2**20 and cfg.parse_size("512k") == 512_000
    with pytest.raises(ValueError):
        cfg.parse_duration("soon")


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("grpc-port: 7000\nrefresh-metrics-interval: 100ms\nmax_body_bytes: 1Mi\n")
    args = argparse.Namespace(config_file=str(path), grpc_port=7001, endpoints="10.0.0.1:8000")
    config = cfg.resolve(args)
    assert (config.grpc_port, config.refresh_metrics_interval, config.max_body_bytes) == (7001, 0.1, 2**20)
    with pytest.raises(ValueError, match="no endpoint source"):
        cfg.resolve(argparse.Namespace(config_file=str(path)))  # nothing to route to: say so at start-up
    with pytest.raises(ValueError, match="log-level 'verbose'"):
        cfg.resolve(argparse.Namespace(endpoints="10.0.0.1:8000", log_level="verbose"))
    path.write_text("grpc-prot: 1\n")
    with pytest.raises(cfg.ConfigError, match="picker.yaml: grpc-prot: unknown key"):
        cfg.resolve(args)
    path.write_text("grpc-port: 7000\n")  # the flag wins over the file, however the file spells the key
    assert cfg.resolve(argparse.Namespace(config_file=str(path), grpc_port=7001, endpoints="x:1")).grpc_port == 7001


def test_endpoint_sources(tmp_path: Path) -> None:
    specs = parse_endpoint_list("10.0.0.1:8000, [::1]:9000, pod-a:8000")
    assert [(s.host, s.port, s.named) for s in specs] == [("10.0.0.1", 8000, False), ("::1", 9000, False),
                                                            ("pod-a", 8000, True)]
    with pytest.raises(ValueError, match="not an IP address nor a host name"):
        parse_endpoint_list("pod a:8000")
    path = tmp_path / "eps.yaml"
    path.write_text("endpoints:\n- 10.0.0.1:8000\n- {address: 10.0.0.2:8000, name: pod-b}\n")
    pool = EndpointPool()
    StaticEndpoints(pool).set_specs(load_endpoints_file(path))
    assert sorted(e.name for e in pool.all()) == ["10.0.0.1:8000", "pod-b"]


async def test_names_are_resolved_and_followed() -> None:
    answers: dict[str, list[str] | OSError] = {"vllm": ["10.0.0.5", "10.0.0.6"], "late": OSError("no such host")}

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer

    pool = EndpointPool()
    static = StaticEndpoints(pool, resolver)
    static.set_specs(parse_endpoint_list("10.0.0.1:8000,vllm:8000,late:9000"))
    assert [e.address for e in pool.all()] == ["10.0.0.1:8000"]  # names count once resolved
    await static.resolve()
    assert sorted(e.address for e in pool.all()) == ["10.0.0.1:8000", "10.0.0.5:8000", "10.0.0.6:8000"]
    assert pool.get("10.0.0.5:8000").name == "vllm:8000/10.0.0.5"  # type: ignore[union-attr]
    answers["vllm"] = ["10.0.0.7"]  # a restart on another address
    answers["late"] = ["10.0.0.9"]  # a container that was still starting
    await static.resolve()
    assert sorted(e.address for e in pool.all()) == ["10.0.0.1:8000", "10.0.0.7:8000", "10.0.0.9:9000"]
    assert pool.get("10.0.0.7:8000").name == "vllm:8000"  # type: ignore[union-attr]
    answers["vllm"] = OSError("resolver down")  # a failure keeps the last addresses
    await static.resolve()
    assert sorted(e.address for e in pool.all()) == ["10.0.0.1:8000", "10.0.0.7:8000", "10.0.0.9:9000"]


async def test_localhost_resolves_to_its_ipv4_address() -> None:
    assert await resolve_name("localhost", 8000) == ["127.0.0.1"]


def test_file_watcher_replaces_pool_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "eps.json"
    path.write_text(json.dumps(["10.0.0.1:8000", "10.0.0.2:8000"]))
    pool = EndpointPool()
    removed: list[str] = []
    pool.subscribe(lambda event, e: removed.append(e.address) if event is PoolEvent.REMOVED else None)
    watcher = EndpointsFileWatcher(path, StaticEndpoints(pool))
    assert watcher.load_now() and len(pool) == 2
    kept = pool.get("10.0.0.1:8000")
    path.write_text(json.dumps(["10.0.0.1:8000"]) + " ")
    assert watcher.load_now() and removed == ["10.0.0.2:8000"] and pool.get("10.0.0.1:8000") is kept
    path.write_text("{broken json")
    assert not watcher.load_now() and len(pool) == 1


def test_readme_config_example_builds_the_policy(tmp_path: Path) -> None:
    from picker.serving.policy import build_policy

    readme = (Path(__file__).resolve().parents[1] / "docs" / "scheduling.md").read_text()
    example = readme.split("# picker.yaml (picker serve --config-file picker.yaml)\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "picker.yaml"
    path.write_text(example)
    config = cfg.resolve(argparse.Namespace(config_file=str(path)))
    assert config.admission.objectives == {"batch": -1, "interactive": 1}
    assert config.metrics_slow_interval == 1.0 and config.refresh_metrics_interval is None
    policy = build_policy(config)
    assert config.admission.max_wait == pytest.approx(0.5)
    assert policy.priorities.of(InferenceRequest("r", "m", objective="batch")) == -1


def test_abbreviated_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from picker.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--endpoints-fil", "pool.yaml"])  # once taken for --endpoints-file, silently
    assert exit_info.value.code == 2 and "--endpoints-fil" in capsys.readouterr().err
