"""The parsed inference request: what the decision core knows about one HTTP request.

Parsing is separate from the ext_proc state machine so the same request object feeds the servicer, the
`Explain` API and the in-process benchmark.
"""

from __future__ import annotations

import enum
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from picker.core import headers as names
from picker.core.media import DEFAULT_MEDIA, MediaItem, MediaTokens, MultimodalConfig, marker, media_of

# Characters per token where nothing better is known: the prompt's text stands for its tokens at this rate (the
# prefix index's blocks, media markers, token estimates).
CHARS_PER_TOKEN = 4


class ApiKind(enum.Enum):
    """OpenAI-style API families, told apart by the `:path` suffix."""

    CHAT = "chat/completions"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    CONVERSATIONS = "conversations"
    MESSAGES = "messages"  # Anthropic's Messages API, which vLLM serves too


# Longest suffix first so "/chat/completions" is not taken for "/completions".
_PATH_SUFFIXES: tuple[tuple[str, ApiKind], ...] = (
    ("/chat/completions", ApiKind.CHAT),
    ("/completions", ApiKind.COMPLETIONS),
    ("/responses", ApiKind.RESPONSES),
    ("/embeddings", ApiKind.EMBEDDINGS),
    ("/conversations", ApiKind.CONVERSATIONS),
    ("/messages", ApiKind.MESSAGES),
)


def api_kind_for_path(path: str) -> ApiKind | None:
    """Map a request path (query string ignored) to its API family; None for an unknown path."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, kind in _PATH_SUFFIXES:
        if path.endswith(suffix):
            return kind
    return None


# Every inference API is POST; OPTIONS (a CORS preflight) passes to the pod, which answers it.
_PREFLIGHT = "OPTIONS"


class RequestError(Exception):
    """A request the picker refuses, with the HTTP status and machine-readable code the client gets."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


@dataclass(slots=True)
class InferenceRequest:
    """One request as the scheduler sees it. `prompt_text` is the canonical text prefix keys are made from."""

    request_id: str
    model: str
    api: ApiKind | None = None
    path: str = ""
    prompt_text: str = ""
    stream: bool = False
    max_tokens: int | None = None
    objective: str | None = None
    priority: int = 0
    fairness_id: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    target_model: str | None = None  # the model the pod gets: x-gateway-model-name-rewrite, or a rewrite rule's
    rewrite_rule: str = ""  # the rule that set target_model ("" with the header)
    slo_ttft_s: float | None = None  # x-slo-ttft-ms: the first token wanted within this many seconds
    subset: tuple[str, ...] | None = None  # Envoy subset hint: allowed "ip:port" (or "ip") values
    body_bytes: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    # The validated body, kept (a reference, no copy) until the director has had it tokenized or knows it will
    # not be: precise prefix routing renders its messages or prompt as the pod will (`tokenize_input`)
    parsed: dict[str, Any] | None = None
    token_ids: list[int] | None = None  # the prompt's tokens, when a tokenizer gave them
    media: tuple[MediaItem, ...] = ()  # the prompt's images, audio and video, as its text holds them

    @property
    def has_body(self) -> bool:
        return self.api is not None


def route_kind(headers: dict[str, str], has_body: bool) -> ApiKind | None:
    """The API family a request is routed as; None for a header-only pass-through (GET /v1/models, ...).

    Refuses what no inference server would accept: an inference API called with another method than POST (405,
    with `allow`), an inference call without a body (400), a body sent to a path that is no inference API (404).
    """
    path = headers.get(":path", "")
    api = api_kind_for_path(path)
    method = headers.get(":method", "POST").upper()
    if method == _PREFLIGHT:
        return None
    if api is not None and method != "POST":
        raise RequestError(405, "method_not_allowed", f"{method} is not allowed on {path.split('?', 1)[0]!r}: "
                           f"the {api.value} API takes POST", {names.ALLOW: "POST"})
    if not has_body:
        if api is not None:
            raise RequestError(400, "empty_body", f"a {api.value} request needs a JSON body")
        return None
    if api is None:
        raise RequestError(404, "unknown_path", f"path {path.split('?', 1)[0]!r} is not an inference API this "
                           "picker routes (/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, "
                           "/v1/conversations, /v1/messages)")
    return api


def _text_of_content(content: Any, media: MediaTokens, found: list[MediaItem]) -> str:
    """Text of an OpenAI message `content`: a string, or the text and media parts of a multi-part list (a media
    part as its marker, picker.core.media, and added to `found`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                    continue
                try:
                    item = media_of(part, media)
                except ValueError as exc:
                    raise RequestError(400, "invalid_media", f"a {part.get('type')} part: {exc}") from None
                if item is not None:
                    found.append(item)
                    parts.append(marker(item, CHARS_PER_TOKEN))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    if content is None:
        return ""
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def render_messages(messages: list[Any], tools: Any = None, media: MediaTokens = DEFAULT_MEDIA,
                    found: list[MediaItem] | None = None) -> str:
    """Render chat messages into one canonical text so equal conversation prefixes give equal text prefixes.

    The layout mimics a chat template (role header, content, end marker) so its length tracks the
    tokens the model server will see; tools come first because templates put them in the system part.
    """
    out: list[str] = []
    if tools:
        out.append("<|tools|>" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "<|end|>\n")
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError(400, "invalid_messages", "every entry of 'messages' must be an object")
        role = message.get("role", "user")
        out.append(f"<|{role}|>\n{_text_of_content(message.get('content'), media, found if found is not None else [])}"
                   "<|end|>\n")
    return "".join(out)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        # A list of strings (batch) or of token ids: both have a stable text form.
        if all(isinstance(p, str) for p in prompt):
            return "".join(prompt)
        return json.dumps(prompt, separators=(",", ":"))
    raise RequestError(400, "invalid_prompt", "'prompt' must be a string or a list")


def _slo_seconds(value: str | None) -> float | None:
    """`x-slo-ttft-ms: 250` -> 0.25 s; a value that is no positive number is the client's 400."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not ms > 0 or ms == float("inf"):
        raise RequestError(400, "invalid_header", f"{names.SLO_TTFT} must be a positive number of milliseconds, "
                                                  f"not {value!r}")
    return ms / 1000.0


def _too_deep() -> RequestError:
    # The C decoder and encoder recurse once per nesting level: a body like `[[[[...` must be the client's
    # 400, not an exception that ends the ext_proc stream (Envoy would then fail open to a pod).
    return RequestError(400, "invalid_json", "request body is nested too deeply")


# Valid UTF-8 cannot hold a surrogate, so a lone one can only come from a JSON escape (\\ud800): a byte search
# that allocates nothing spares almost every body the walk below.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(data: Any) -> None:
    """400 for any string (key or value) holding a lone surrogate: it has no UTF-8 form, so it could reach
    neither the prefix hash nor a metric label nor the model server intact. Iterative: the body may be deep."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(f"{where}.{key}" if where else key, key)
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(where, value)


def _check_text(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        field = where.encode("utf-8", "backslashreplace").decode("utf-8") or "body"  # the name may hold one too
        raise RequestError(400, "invalid_text", f"{field}: text holds a lone surrogate "
                           f"(\\u{ord(text[exc.start]):04x}) that no UTF-8 text can carry") from None


def parse_body(body: bytes, api: ApiKind) -> dict[str, Any]:
    """Decode and validate a JSON request body; errors carry the 400 the client should get."""
    if not body:
        raise RequestError(400, "empty_body", f"a {api.value} request needs a JSON body")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, "invalid_utf8", f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(400, "invalid_json", f"request body is not JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # the only other thing the decoder raises: an integer past the 4,300-digit limit
        raise RequestError(400, "invalid_json", "request body holds an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits") from None
    if not isinstance(data, dict):
        raise RequestError(400, "invalid_json", "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body) is not None:
        _refuse_lone_surrogates(data)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "missing_model", "request body has no 'model' string")
    return data


def _messages(data: dict[str, Any], kind: str) -> list[Any]:
    """A chat-shaped body's non-empty `messages` list; RequestError 400 naming the request kind otherwise."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "missing_messages", f"{kind} request has no 'messages' list")
    return messages


def prompt_of(data: dict[str, Any], api: ApiKind, media: MediaTokens = DEFAULT_MEDIA,
              found: list[MediaItem] | None = None) -> str:
    """The canonical prompt text of a validated body for its API family (media parts as `media` counts them, each
    added to `found`)."""
    if api is ApiKind.CHAT:
        return render_messages(_messages(data, "chat completions"), data.get("tools"), media, found)
    if api is ApiKind.COMPLETIONS:
        if "prompt" not in data:
            raise RequestError(400, "missing_prompt", "completions request has no 'prompt'")
        return _prompt_text(data["prompt"])
    if api is ApiKind.RESPONSES:
        item = data.get("input")
        if item is None:
            raise RequestError(400, "missing_input", "responses request has no 'input'")
        instructions = data.get("instructions") or ""
        if isinstance(item, list):
            return str(instructions) + render_messages([m for m in item if isinstance(m, dict)], media=media,
                                                       found=found)
        return str(instructions) + _prompt_text(item)
    if api is ApiKind.EMBEDDINGS:
        if "input" not in data:
            raise RequestError(400, "missing_input", "embeddings request has no 'input'")
        return _prompt_text(data["input"])
    if api is ApiKind.MESSAGES:
        messages = _messages(data, "messages")
        system = data.get("system")  # a string or text blocks, ahead of the turns as a chat template puts it
        turns = [{"role": "system", "content": system}, *messages] if system else messages
        return render_messages(turns, data.get("tools"), media, found)
    # Conversations carry items, not a prompt: route on the model alone.
    return ""


def build_request(
    headers: dict[str, str],
    body: bytes,
    *,
    request_id: str,
    subset: tuple[str, ...] | None = None,
    media: MultimodalConfig = DEFAULT_MEDIA,
) -> InferenceRequest:
    """Turn request headers (+ body, when the API has one) into an InferenceRequest; RequestError on bad input.
    Media parts count as many tokens as `media` says the request's model counts them.

    With no body, the request is a header-only pass-through (`api` None) or refused by `route_kind`.
    """
    path = headers.get(":path", "")
    api = route_kind(headers, has_body=bool(body))
    request = InferenceRequest(
        request_id=request_id,
        model="",
        api=api,
        path=path,
        objective=headers.get(names.OBJECTIVE),
        fairness_id=headers.get(names.FAIRNESS_ID) or headers.get(names.GATEWAY_FAIRNESS_ID),
        session_id=headers.get(names.SESSION_ID),
        target_model=headers.get(names.MODEL_REWRITE),
        slo_ttft_s=_slo_seconds(headers.get(names.SLO_TTFT)),
        subset=subset,
        body_bytes=len(body),
        headers=headers,
    )
    if api is None:
        return request
    data = parse_body(body, api)
    request.model = data["model"]
    try:
        found: list[MediaItem] = []
        request.prompt_text = prompt_of(data, api, media.for_model(request.model), found)
        request.media = tuple(found)
    except RecursionError:  # a prompt that parsed, close to the limit, but is too deep to re-encode
        raise _too_deep() from None
    request.stream = bool(data.get("stream"))
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    request.max_tokens = max_tokens if isinstance(max_tokens, int) else None
    salt = data.get("cache_salt")
    request.cache_salt = salt if isinstance(salt, str) else None
    request.parsed = data
    return request


def tokenize_input(request: InferenceRequest) -> dict[str, Any] | None:
    """What a tokenizer renders for the request as its pod will (`messages`, or `prompt`), from the kept body;
    None for an API without a prompt to tokenize, or once the body was let go."""
    data = request.parsed
    if data is None:
        return None
    if request.api is ApiKind.CHAT:
        return {"messages": data["messages"]}
    if request.api is ApiKind.MESSAGES:  # the system prompt ahead of the turns, as the chat template will put it
        system = data.get("system")
        turns = data["messages"]
        return {"messages": [{"role": "system", "content": system}, *turns] if system else turns}
    if request.api is ApiKind.COMPLETIONS:
        return {"prompt": data["prompt"]}
    return None


@dataclass(slots=True)
class Usage:
    """The token counts a model server reports for one request (OpenAI's `usage` object)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prefix-cache hits


# The most output tokens one request is counted for in flight: past any model's context. A client may ask for any
# max_tokens (the pod refuses what it cannot serve); counted as asked, 10**400 broke every later load score.
MAX_COUNTED_OUTPUT_TOKENS = 10_000_000


def estimated_tokens(request: InferenceRequest, chars_per_token: int) -> int:
    """A cheap token estimate (the scheduling config's prefixCache.charsPerToken) for in-flight accounting
    before metrics catch up."""
    asked = min(max(request.max_tokens or 0, 0), MAX_COUNTED_OUTPUT_TOKENS)
    return len(request.prompt_text) // chars_per_token + asked
