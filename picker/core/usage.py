"""Token usage read from responses passing through ext_proc (JSON bodies and SSE `data:` lines).

Only when Envoy sends response bodies (the FULL_DUPLEX config does). Feeds GIE's token histograms and the
prefix-cache hits the model server really had (`prompt_tokens_details.cached_tokens`, or Anthropic's
`cache_read_input_tokens` on `/v1/messages`).
"""

from __future__ import annotations

import json

from picker.core.requests import Usage

_MAX_JSON_BYTES = 1 << 20  # a non-streamed body larger than this is not parsed for usage


def _usage_of(obj: object, before: Usage | None) -> Usage | None:
    """The usage an OpenAI-style body or chunk reports, or an Anthropic Messages one (`usage`, or
    `message.usage` in its `message_start` event). Anthropic's `input_tokens` leave out the cached ones
    (`cache_read_input_tokens`) and those written to the cache, so the prompt is their sum; a later event that
    leaves a count out (Anthropic's `message_delta` may carry only `output_tokens`) keeps the one seen before."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        message = obj.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if not isinstance(usage, dict):
            return None
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                     int(cached or 0))
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return None
    prior = before or Usage()
    if "input_tokens" in usage:
        cached = int(usage.get("cache_read_input_tokens") or 0)
        prompt = int(usage["input_tokens"] or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    else:
        prompt, cached = prior.prompt_tokens, prior.cached_tokens
    output = int(usage["output_tokens"] or 0) if "output_tokens" in usage else prior.completion_tokens
    return Usage(prompt, output, cached)


class UsageReader:
    """Feed response chunks in order; `usage` holds the last usage object seen."""

    __slots__ = ("sse", "buffer", "usage", "overflow")

    def __init__(self, content_type: str) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.buffer = bytearray()
        self.usage: Usage | None = None
        self.overflow = False

    def feed(self, chunk: bytes, end_of_stream: bool) -> None:
        if self.sse:
            self._feed_sse(chunk)
        elif not self.overflow:
            self.buffer += chunk
            if len(self.buffer) > _MAX_JSON_BYTES:
                self.overflow, self.buffer = True, bytearray()
            elif end_of_stream and b'"usage"' in self.buffer:
                self._parse(bytes(self.buffer))

    def _feed_sse(self, chunk: bytes) -> None:
        # Keep only the unfinished last line between chunks; usage rides on one `data:` line.
        self.buffer += chunk
        *lines, rest = self.buffer.split(b"\n")
        self.buffer = bytearray(rest)
        for line in lines:
            if line.startswith(b"data: {") and b'"usage"' in line:
                self._parse(line[6:])

    def _parse(self, data: bytes | bytearray) -> None:
        try:
            usage = _usage_of(json.loads(data), self.usage)
        except (ValueError, TypeError):
            return
        if usage is not None:
            self.usage = usage
