"""Usage parsing from response bodies: JSON, SSE split across chunks, and garbage."""

from __future__ import annotations

import json

from picker.core.usage import UsageReader

USAGE = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96}}


def test_json_body_in_chunks() -> None:
    body = json.dumps({"id": "x", "choices": [], "usage": USAGE}).encode()
    reader = UsageReader("application/json")
    for i in range(0, len(body), 10):
        reader.feed(body[i:i + 10], i + 10 >= len(body))
    assert reader.usage is not None
    assert (reader.usage.prompt_tokens, reader.usage.completion_tokens, reader.usage.cached_tokens) == (120, 7, 96)


def test_sse_usage_line_split_across_chunks() -> None:
    stream = (b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
              + b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\ndata: [DONE]\n\n")
    reader = UsageReader("text/event-stream; charset=utf-8")
    for i in range(0, len(stream), 7):
        reader.feed(stream[i:i + 7], False)
    assert reader.usage is not None and reader.usage.cached_tokens == 96


def test_no_or_broken_usage() -> None:
    reader = UsageReader("application/json")
    reader.feed(b'{"usage": "nope"', True)
    assert reader.usage is None
    reader = UsageReader("text/event-stream")
    reader.feed(b'data: {"usage": {"prompt_tokens": "x"\n', False)
    assert reader.usage is None


def test_anthropic_usage_adds_the_cached_tokens_back() -> None:
    """vLLM's /v1/messages: input_tokens leave out cache reads (and writes); the prompt is the sum."""
    reply = {"type": "message", "content": [], "usage": {"input_tokens": 24, "output_tokens": 7,
                                                          "cache_read_input_tokens": 96}}
    reader = UsageReader("application/json")
    reader.feed(json.dumps(reply).encode(), True)
    assert reader.usage is not None
    assert (reader.usage.prompt_tokens, reader.usage.completion_tokens, reader.usage.cached_tokens) == (120, 7, 96)


def test_an_anthropic_stream_takes_input_from_message_start_and_output_from_message_delta() -> None:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 20, "output_tokens": 1,
                                                            "cache_read_input_tokens": 64,
                                                            "cache_creation_input_tokens": 16}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}
    stream = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (start, delta))
    reader = UsageReader("text/event-stream")
    for i in range(0, len(stream), 11):
        reader.feed(stream[i:i + 11], False)
    assert reader.usage is not None
    assert (reader.usage.prompt_tokens, reader.usage.completion_tokens, reader.usage.cached_tokens) == (100, 9, 64)
