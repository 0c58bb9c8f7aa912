"""OpenAI-compatible request parsing and response bodies, shaped like vLLM 0.32's (pure functions, no I/O).

Kept apart from the aiohttp server so the JSON shapes can be tested (and reused by a fast-mode benchmark) without
sockets. Error bodies are vLLM's: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from picker.sim.tokenizer import Tokenizer, render_chat

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


class ApiError(Exception):
    """An error vLLM would answer with a JSON ErrorResponse."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's error JSON."""
        err_type = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
            self.status, HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        )
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ServedModel:
    """What the API layer must know about the served model and adapters."""

    name: str
    root: str
    max_model_len: int
    tokenizer: Tokenizer
    lora_modules: Mapping[str, str] = field(default_factory=dict)


@dataclass
class GenerationPlan:
    """A validated generation request: one engine request per (prompt, choice)."""

    kind: str  # "completion" | "chat"
    model: str  # name echoed in responses (the adapter name for LoRA requests)
    lora_name: str | None
    prompts: list[list[int]]
    max_tokens: list[int]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str | None = None
    echo_role: str = "assistant"


def dumps(obj: Any) -> str:
    """Compact JSON as FastAPI/pydantic write it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def resolve_model(body: Mapping[str, Any], served: ServedModel) -> tuple[str, str | None]:
    """(model name for responses, LoRA adapter or None); unknown names are a 404 like vLLM."""
    model = body.get("model")
    if model is None or model == served.name:
        return served.name, None
    if isinstance(model, str) and model in served.lora_modules:
        return model, model
    aliases = ", ".join([served.name, *served.lora_modules])
    raise ApiError(f"The model `{model}` does not exist. Valid aliases: {aliases}.", 404, "model")


def _int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"`{name}` must be an integer.", 400, name)
    if value < minimum:
        raise ApiError(f"{name} must be at least {minimum}, got {value}.", 400, name)
    return value


def _check_lengths(prompt_len: int, max_tokens: int | None, served: ServedModel) -> int:
    """vLLM's context-length checks; returns the effective max_tokens."""
    limit = served.max_model_len
    if prompt_len >= limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, your prompt contains {prompt_len} "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
            f"input prompt. (parameter=input_tokens, value={prompt_len})",
            400,
            "input_tokens",
        )
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise ApiError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {limit} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {limit} - {prompt_len}).",
            400,
            "max_tokens",
        )
    return max_tokens


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options and not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", 400, "stream_options")
    options = options if isinstance(options, Mapping) else {}
    include = bool(options.get("include_usage", False))
    continuous = include and bool(options.get("continuous_usage_stats", False))
    return stream, include, continuous


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", 400, "cache_salt")
    return {
        "n": _int_field(body, "n", 1, 1) or 1,
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "min_tokens": _int_field(body, "min_tokens", 0, 0) or 0,
        "cache_salt": salt,
    }


def prompt_token_lists(prompt: Any, tokenizer: Tokenizer, add_special_tokens: bool = True) -> list[list[int]]:
    """Completions `prompt`: a string, a list of strings, a token-id list or a list of token-id lists."""
    empty = ApiError("Either prompt or prompt_embeds must be provided and non-empty.", 400, "prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise empty
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens)]
    if isinstance(prompt, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [_checked_ids(prompt, tokenizer)]
        out: list[list[int]] = []
        for item in prompt:
            if isinstance(item, str):
                out.append(tokenizer.encode(item, add_special_tokens))
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                out.append(_checked_ids(item, tokenizer))
            else:
                raise ApiError("prompt must be a string, array of strings, or array of token arrays.", 400, "prompt")
        return out
    raise ApiError("prompt must be a string, array of strings, or array of token arrays.", 400, "prompt")


def _checked_ids(ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    for t in ids:
        if t < 0 or t >= tokenizer.vocab_size:
            raise ApiError(f"Token id {t} is out of vocabulary", 400, "prompt")
    return list(ids)


def parse_completion(body: Any, served: ServedModel) -> GenerationPlan:
    """Validate a /v1/completions body."""
    if not isinstance(body, Mapping):
        raise ApiError("Request body must be a JSON object.", 400)
    model, lora = resolve_model(body, served)
    stream, include, continuous = _stream_options(body)
    common = _common(body)
    max_tokens = _int_field(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, 1)
    prompts = prompt_token_lists(body.get("prompt"), served.tokenizer)
    limits = [_check_lengths(len(p), max_tokens, served) for p in prompts]
    return GenerationPlan("completion", model, lora, prompts, limits, stream=stream, include_usage=include,
                          continuous_usage=continuous, **common)  # fmt: skip


def chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """Render and tokenize `messages` (the template carries BOS, so no extra special tokens)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list.", 400, "messages")
    try:
        text = render_chat(messages, bool(body.get("add_generation_prompt", True)))
    except ValueError as exc:
        raise ApiError(str(exc), 400, "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def parse_chat(body: Any, served: ServedModel) -> GenerationPlan:
    """Validate a /v1/chat/completions body."""
    if not isinstance(body, Mapping):
        raise ApiError("Request body must be a JSON object.", 400)
    model, lora = resolve_model(body, served)
    stream, include, continuous = _stream_options(body)
    common = _common(body)
    max_tokens = _int_field(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", None, 1)
    prompt = chat_prompt(body, served.tokenizer)
    limit = _check_lengths(len(prompt), max_tokens, served)
    return GenerationPlan("chat", model, lora, [prompt], [limit], stream=stream, include_usage=include,
                          continuous_usage=continuous, **common)  # fmt: skip


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
    rid: str, created: int, model: str, choices: list[ChoiceResult], use: dict[str, Any], fingerprint: str
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
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_response(
    rid: str, created: int, model: str, choices: list[ChoiceResult], use: dict[str, Any], fingerprint: str
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
        "kv_transfer_params": None,
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
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
