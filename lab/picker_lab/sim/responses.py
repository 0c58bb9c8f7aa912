"""OpenAI-compatible response bodies and stream chunks, shaped like vLLM 0.32's (pure functions, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from picker_lab.sim.openai_api import json_bytes


# --- response bodies -----------------------------------------------------------------------------------------
def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, created_cache_tokens: int | None = None
) -> dict[str, Any]:
    """UsageInfo in vLLM's field order (prompt_tokens_details as with --enable-prompt-tokens-details).

    `created_cache_tokens` is null in completions and an int in chats in vLLM 0.32 (checked by validate_sim).
    """
    details = None
    if cached_tokens is not None:
        details = {"cached_tokens": cached_tokens, "created_cache_tokens": created_cache_tokens,
                   "multimodal_tokens": None}  # fmt: skip
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


@dataclass
class ChoiceResult:
    """Final text of one choice."""

    index: int
    text: str
    finish_reason: str | None


def completion_response(
    rid: str, created: int, model: str, choices: list[ChoiceResult], use: dict[str, Any], fingerprint: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Non-streaming /v1/completions body."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for c in choices
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": use,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_response(
    rid: str, created: int, model: str, choices: list[ChoiceResult], use: dict[str, Any], fingerprint: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Non-streaming /v1/chat/completions body."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {
                    "role": "assistant",
                    "content": c.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            for c in choices
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": use,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    use: dict[str, Any] | None = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """One streamed completion delta (pydantic exclude_unset: only fields vLLM sets)."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }
    if use is not None:
        chunk["usage"] = use
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    use: dict[str, Any] | None = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """One streamed chat delta; the first carries {"role": "assistant", "content": ""} (and, as in vLLM 0.32,
    top-level prompt_token_ids/prompt_text), later ones token_ids, the last one stop_reason."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    first = "role" in delta
    if finish_reason is not None:
        choice["stop_reason"] = None
    if not first:
        choice["token_ids"] = None
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if first:
        chunk["prompt_token_ids"] = None
        chunk["prompt_text"] = None
    if use is not None:
        chunk["usage"] = use
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def usage_chunk(rid: str, created: int, model: str, kind: str, use: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    """The final `stream_options.include_usage` chunk: empty choices, None fields dropped (exclude_none)."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    clean_usage = _drop_none(use)
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": clean_usage,
        "system_fingerprint": fingerprint,
    }


def _drop_none(obj: dict[str, Any]) -> dict[str, Any]:
    """pydantic's exclude_none, recursively."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in obj.items() if v is not None}


def sse(obj: Any) -> bytes:
    """One server-sent event as vLLM writes it."""
    return b"data: " + json_bytes(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
