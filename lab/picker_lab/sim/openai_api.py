"""OpenAI-compatible request parsing, shaped like vLLM 0.32's (pure functions, no I/O; the bodies it answers with
are picker_lab/sim/responses.py).

Kept apart from the aiohttp server so the JSON shapes can be tested (and reused by a fast-mode benchmark) without
sockets. Error bodies are vLLM's: `{"error": {"message", "type", "param", "code"}}`.

Every body field the sim reads is type-checked here, as vLLM's pydantic models and SamplingParams do: a
wrong-typed body gets a 400 naming the field ("messages[0].role: must be a string") instead of being coerced
(`bool("yes")`, `str(5)`) or reaching the engine, where a lone surrogate in `cache_salt` once crashed block
hashing and hung the pod.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from picker_lab.sim.tokenizer import Tokenizer, is_utf8, render_chat

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: a larger `n` is a 400, not n engine requests


class ApiError(Exception):
    """An error vLLM would answer with a JSON ErrorResponse."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's error JSON."""
        err_type = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
                    500: "InternalServerError"}.get(
            self.status, HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        )
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.status}}


def internal_error() -> ApiError:
    """What vLLM answers when a request fails inside the engine (finish_reason "error": GenerationError)."""
    return ApiError("Internal server error", 500)


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
    # vLLM's KV-connector handshake (P/D): do_remote_decode asks to keep the KV for a decode pod,
    # do_remote_prefill says the KV comes from a prefill pod
    kv_transfer: Mapping[str, Any] | None = None

    @property
    def remote_decode(self) -> bool:
        return bool(self.kv_transfer and self.kv_transfer.get("do_remote_decode"))

    @property
    def remote_prefill(self) -> bool:
        return bool(self.kv_transfer and self.kv_transfer.get("do_remote_prefill"))


def dumps(obj: Any) -> str:
    """Compact JSON as FastAPI/pydantic write it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_bytes(obj: Any) -> bytes:
    """`dumps` as UTF-8 for a response body; a lone surrogate (not encodable as UTF-8) is written as a \\uXXXX
    escape rather than failing the response, so an error about a bad string can always be sent."""
    try:
        return dumps(obj).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


# --- request validation ---------------------------------------------------------------------------------
_TOP_FIELD = re.compile(r"[.\[]")


def invalid(path: str, problem: str) -> ApiError:
    """A 400 naming the offending field, e.g. "messages[0].role: must be a string"; param: the top field."""
    return ApiError(f"{path}: {problem}", 400, _TOP_FIELD.split(path, maxsplit=1)[0] or None)


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Path of the first string (or object key) in `value` that UTF-8 cannot encode, e.g. the JSON text
    "\\ud800" (json.loads accepts lone surrogates); None when every string is valid text."""
    if isinstance(value, str):
        return None if is_utf8(value) else path or "body"
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not is_utf8(key):
                return where
            if type(item) is not int:
                found = lone_surrogate_path(item, where)
                if found is not None:
                    return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if type(item) is not int:  # token-id lists are the big ones: skip their items cheaply
                found = lone_surrogate_path(item, f"{path}[{i}]")
                if found is not None:
                    return found
    return None


def check_text(body: Mapping[str, Any]) -> None:
    """400 if any string of the body holds a lone surrogate: it can be neither tokenized, hashed into a block
    key (cache_salt) nor echoed back as UTF-8, and vLLM rejects such bodies."""
    try:
        path = lone_surrogate_path(body)
    except RecursionError:
        raise ApiError("Request body is nested too deeply.", 400) from None
    if path is not None:
        raise invalid(path, "must be valid UTF-8 text (it contains a lone surrogate)")


def _body_object(body: Any) -> Mapping[str, Any]:
    """The body as an object, its strings checked (surrogates first: a bad `model` is a 400, not a 404)."""
    if not isinstance(body, Mapping):
        raise ApiError("Request body must be a JSON object.", 400)
    check_text(body)
    return body


def _bool_field(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """A JSON boolean (or null/absent: `default`); "yes" or 1 are refused rather than coerced."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, "must be a boolean")
    return value


def _float_field(body: Mapping[str, Any], name: str) -> float | None:
    """A JSON number (not a bool) as a float, as pydantic hands it to vLLM; an int too big for one is inf."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, "must be a number")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _check_sampling(body: Mapping[str, Any]) -> None:
    """temperature and top_p as vLLM's SamplingParams checks them (json.loads accepts NaN as a number)."""
    temperature = _float_field(body, "temperature")
    if temperature is not None:
        if not math.isfinite(temperature):
            raise ApiError(f"temperature must be a finite number, got {temperature}. "
                           f"(parameter=temperature, value={temperature})", 400, "temperature")  # fmt: skip
        if not 0.0 <= temperature <= 2.0:
            raise ApiError(f"temperature must be in [0, 2], got {temperature}. "
                           f"(parameter=temperature, value={temperature})", 400, "temperature")  # fmt: skip
    top_p = _float_field(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:  # true for NaN too
        raise ApiError(f"top_p must be in (0, 1], got {top_p}. (parameter=top_p, value={top_p})", 400,
                       "top_p")  # fmt: skip


def _check_stop(body: Mapping[str, Any]) -> None:
    """stop: a string, a list of strings or null."""
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list):
        raise invalid("stop", "must be a string or a list of strings")
    for i, item in enumerate(stop):
        if not isinstance(item, str):
            raise invalid(f"stop[{i}]", "must be a string")


def _check_tools(body: Mapping[str, Any]) -> None:
    """tools: a list of objects or null (the sim ignores them, but vLLM refuses other shapes)."""
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise invalid(f"tools[{i}]", "must be an object")


def _check_request_fields(body: Mapping[str, Any]) -> None:
    """Fields both endpoints share that the plan does not carry (vLLM checks them, so the sim does)."""
    _check_sampling(body)
    _check_stop(body)


def _check_content_part(path: str, part: Any) -> None:
    """One content part: a string, or an object with a string `type` (a "text" part needs a string `text`)."""
    if isinstance(part, str):
        return
    if not isinstance(part, Mapping):
        raise invalid(path, "must be a content-part object or a string")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise invalid(f"{path}.type", "must be a string")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise invalid(f"{path}.text", "must be a string")


def _check_message(path: str, message: Any) -> None:
    """One chat message: an object with a string role; content a string, a list of parts or null."""
    if not isinstance(message, Mapping):
        raise invalid(path, "must be an object")
    if "role" not in message:
        raise invalid(f"{path}.role", "is required")
    if not isinstance(message["role"], str):
        raise invalid(f"{path}.role", "must be a string")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(f"{path}.content", "must be a string, a list of content parts or null")
    for j, part in enumerate(content):
        _check_content_part(f"{path}.content[{j}]", part)


def check_messages(messages: Any) -> list[Mapping[str, Any]]:
    """`messages`: a non-empty list of well-typed message objects (what render_chat can render)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list.", 400, "messages")
    for i, message in enumerate(messages):
        _check_message(f"messages[{i}]", message)
    return messages


def resolve_model(body: Mapping[str, Any], served: ServedModel) -> tuple[str, str | None]:
    """(model name for responses, LoRA adapter or None); unknown names are a 404 like vLLM."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")
    if model is None or model == served.name:
        return served.name, None
    if isinstance(model, str) and model in served.lora_modules:
        return model, model
    aliases = ", ".join([served.name, *served.lora_modules])
    raise ApiError(f"The model `{model}` does not exist. Valid aliases: {aliases}.", 404, "model")


def _int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    """An integer >= minimum, or null/absent (`default`); bools and floats are refused."""
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
    """(stream, include_usage, continuous_usage_stats), each a real boolean."""
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise invalid("stream_options", "must be an object")
    if options and not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", 400, "stream_options")
    options = options or {}
    include = _bool_field(options, "include_usage")
    continuous = _bool_field(options, "continuous_usage_stats")
    return stream, include, include and continuous


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    """Plan fields both endpoints share (cache_salt's text was checked by check_text)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", 400, "cache_salt")
    _check_request_fields(body)
    n = _int_field(body, "n", 1, 1) or 1
    if n > MAX_N_SEQUENCES:
        raise ApiError(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
                       "VLLM_MAX_N_SEQUENCES environment variable.", 400, "n")  # fmt: skip
    transfer = body.get("kv_transfer_params")
    if transfer is not None and not isinstance(transfer, Mapping):
        raise invalid("kv_transfer_params", "must be an object")
    return {
        "n": n,
        "ignore_eos": _bool_field(body, "ignore_eos"),
        "min_tokens": _int_field(body, "min_tokens", 0, 0) or 0,
        "cache_salt": salt,
        "kv_transfer": transfer,
    }


def prompt_token_lists(prompt: Any, tokenizer: Tokenizer, add_special_tokens: bool = True) -> list[list[int]]:
    """Completions `prompt`: a string, a list of strings, a token-id list or a list of token-id lists."""
    empty = ApiError("Either prompt or prompt_embeds must be provided and non-empty.", 400, "prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise empty
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens)]
    if isinstance(prompt, list):
        if all(_is_token_id(t) for t in prompt):
            return [_checked_ids(prompt, tokenizer)]
        out: list[list[int]] = []
        for item in prompt:
            if isinstance(item, str):
                out.append(tokenizer.encode(item, add_special_tokens))
            elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
                out.append(_checked_ids(item, tokenizer))
            else:
                raise ApiError("prompt must be a string, array of strings, or array of token arrays.", 400, "prompt")
        return out
    raise ApiError("prompt must be a string, array of strings, or array of token arrays.", 400, "prompt")


def _is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON true is not token 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_ids(ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    for t in ids:
        if t < 0 or t >= tokenizer.vocab_size:
            raise ApiError(f"Token id {t} is out of vocabulary", 400, "prompt")
    return list(ids)


def parse_completion(body: Any, served: ServedModel) -> GenerationPlan:
    """Validate a /v1/completions body."""
    body = _body_object(body)
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
    messages = check_messages(body.get("messages"))
    try:
        text = render_chat(messages, _bool_field(body, "add_generation_prompt", default=True))
    except ValueError as exc:
        raise ApiError(str(exc), 400, "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def parse_chat(body: Any, served: ServedModel) -> GenerationPlan:
    """Validate a /v1/chat/completions body."""
    body = _body_object(body)
    model, lora = resolve_model(body, served)
    stream, include, continuous = _stream_options(body)
    common = _common(body)
    _check_tools(body)
    max_tokens = _int_field(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", None, 1)
    prompt = chat_prompt(body, served.tokenizer)
    limit = _check_lengths(len(prompt), max_tokens, served)
    return GenerationPlan("chat", model, lora, [prompt], [limit], stream=stream, include_usage=include,
                          continuous_usage=continuous, **common)  # fmt: skip
