"""A prompt's token ids, for precise prefix routing: computed here from the model's own files, or asked of a pod.

`LocalTokenizer` (`--tokenizer DIR`: the model directory's tokenizer.json and chat template, read with the
`tokenizers` library and jinja2; the `tokenizer` extra) renders chat messages as vLLM does (the template with
`add_generation_prompt`, then the text tokenized without adding special tokens: the template has them) and
tokenizes completions prompts with the tokenizer's own special tokens. No call leaves the picker.
`PodTokenizer` asks a pod's `POST /tokenize` instead (vLLM and `picker sim` serve it): the pod renders with its own
template, so the ids are exactly those it caches, but every request costs the pod a tokenization in its API
server and the decision a round trip (README, "What the picker costs the pods"); the call is bounded (`timeout`)
and never fails a request, and its answers are kept (`TokenCache`), so a request the picker has seen before (a
retry, a fixed prompt) costs the pod nothing. Either way a completions prompt given as token ids is taken as it
is, and without ids a request is routed on the approximate index.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from picker.core.distribution import install_hint
from picker.core.requests import InferenceRequest, tokenize_input
from picker.endpoints.state import Endpoint

log = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    async def token_ids(self, request: InferenceRequest,
                        candidates: Callable[[], Sequence[Endpoint]]) -> list[int] | None:
        """The prompt's token ids, or None (then the approximate index routes the request); `candidates` gives
        the pods that serve its model, for a tokenizer that asks one (computed only then)."""
        ...

    async def close(self) -> None:
        """Release what it holds (connections)."""
        ...


def given_token_ids(prompt: Any) -> list[int] | None:
    """A completions prompt that is already token ids (one list of ints)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


class TokenCache:
    """Token ids by a digest of what was tokenized, least recently used first out, bounded by the tokens held
    (4 bytes each)."""

    def __init__(self, max_tokens: int = 1 << 21) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()

    @staticmethod
    def key(body: bytes) -> bytes:
        return hashlib.blake2b(body, digest_size=16).digest()

    def get(self, key: bytes) -> list[int] | None:
        ids = self._entries.get(key)
        if ids is None:
            return None
        self._entries.move_to_end(key)
        return ids.tolist()

    def put(self, key: bytes, ids: list[int]) -> None:
        if len(ids) > self.max_tokens or key in self._entries:
            return
        try:
            packed = array("I", ids)
        except OverflowError:  # an id past 32 bits (none known): not kept
            return
        self._entries[key] = packed
        self.tokens += len(packed)
        while self.tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old)


class PodTokenizer:
    """`POST /tokenize` on the least busy candidate (the pods of a model share its tokenizer)."""

    def __init__(self, *, timeout: float = 0.1, scheme: str = "http", cache: TokenCache | None = None) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.scheme = scheme
        self._session: aiohttp.ClientSession | None = None
        self.failures = 0
        self.cache = cache if cache is not None else TokenCache()

    async def token_ids(self, request: InferenceRequest,
                        candidates: Callable[[], Sequence[Endpoint]]) -> list[int] | None:
        given = tokenize_input(request)
        if given is None:
            return None
        direct = given_token_ids(given.get("prompt"))
        if direct is not None:
            return direct
        body = json.dumps({"model": request.target_model or request.model, **given}).encode()
        key = self.cache.key(body)
        known = self.cache.get(key)
        if known is not None:
            return known
        pods = candidates()
        if not pods:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        pod = min(pods, key=lambda e: e.in_flight)
        try:
            async with self._session.post(f"{self.scheme}://{pod.destination}/tokenize", data=body, timeout=self.timeout,
                                          headers={"content-type": "application/json"}) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                tokens = (await response.json(content_type=None)).get("tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 1000 == 0:
                log.info("tokenizing on %s failed (%s; %d so far): routed on the approximate index",
                         pod.address, exc or type(exc).__name__, self.failures)
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            return None
        self.cache.put(key, tokens)
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


OFFLOAD_BYTES = 16 << 10  # bodies this large are tokenized off the event loop


class TokenizerFilesError(ValueError):
    """A --tokenizer directory that cannot be used (says what is missing)."""


def _special(config: dict[str, Any], key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...} in some tokenizer_config.json files
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _text_content(content: Any) -> Any:
    """Message content as a string-format chat template reads it: text parts joined (vLLM does the same)."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


class LocalTokenizer:
    """The model's tokenizer and chat template, loaded once from its directory."""

    def __init__(self, directory: str | Path) -> None:
        try:
            import jinja2.sandbox
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerFilesError(f"needs the tokenizer extra ({exc.name}): {install_hint('tokenizer')}") from None
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise TokenizerFilesError(f"{root}: no tokenizer.json")
        try:
            self._tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            config_path = root / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except Exception as exc:  # OSError, JSON errors, and the bare Exception tokenizers raises for a bad file
            raise TokenizerFilesError(f"{root}: {exc}") from None
        template = (root / "chat_template.jinja").read_text() if (root / "chat_template.jinja").is_file() else \
            config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(template) if isinstance(template, str) else None
        except jinja2.TemplateError as exc:
            raise TokenizerFilesError(f"{root}: its chat template does not parse: {exc}") from None
        self._specials = {"bos_token": _special(config, "bos_token"), "eos_token": _special(config, "eos_token")}
        self.directory = root
        self.segments = SegmentCache(self._tokenizer)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    def ids(self, given: dict[str, Any]) -> list[int] | None:
        """The token ids of a request's tokenize input, or None when it cannot be rendered."""
        if "prompt" in given:
            prompt = given["prompt"]
            direct = given_token_ids(prompt)
            if direct is not None:
                return direct
            return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids) if isinstance(prompt, str) \
                else None
        messages = given.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        turns = [{**m, "content": _text_content(m.get("content"))} for m in messages if isinstance(m, dict)]
        try:
            text = self._template.render(messages=turns, add_generation_prompt=True, **self._specials)
        except Exception as exc:  # a template may raise anything on a conversation it does not accept
            log.debug("chat template failed (%s): routed on the approximate index", exc)
            return None
        return self.segments.encode(text)

    async def token_ids(self, request: InferenceRequest,
                        candidates: Callable[[], Sequence[Endpoint]]) -> list[int] | None:
        """Small prompts here; large ones on the tokenizer's own thread (the tokenizers library releases the
        GIL while it encodes, so other streams go on: a new 34 KB chat takes ~15 ms)."""
        given = tokenize_input(request)
        if given is None:
            return None
        if request.body_bytes < OFFLOAD_BYTES:
            return self.ids(given)
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.ids, given)

    async def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


class SegmentCache:
    """Tokenizes rendered chats piece by piece, remembering the long pieces.

    The tokenizers library cuts a text at its added (special) tokens first and tokenizes each piece between them on
    its own, so a rendered chat's ids are the concatenation of its pieces' ids and the special tokens' ids. A chat
    template puts special tokens around every message, so a system prompt that many requests share is one piece:
    tokenized once, then looked up. Exact only when no added token strips or matches whole words (then every text is
    tokenized whole), and checked against vLLM by `make tokenize-cost`."""

    MIN_CHARS = 256  # shorter pieces are tokenized each time (cheaper than remembering)
    BUDGET_CHARS = 8 << 20  # characters of pieces remembered, least recently used out first

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        plain = all(not (t.lstrip or t.rstrip or t.single_word) for t in added.values())
        self.ids = {t.content: i for i, t in added.items()}
        names = sorted(self.ids, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if plain and names else None
        self.pieces: OrderedDict[str, list[int]] = OrderedDict()
        self.lock = threading.Lock()
        self.chars = 0
        self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        if self.split is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        out: list[int] = []
        for i, piece in enumerate(self.split.split(text)):
            if i % 2:
                out.append(self.ids[piece])
            elif piece:
                out.extend(self._piece(piece))
        return out

    def _piece(self, piece: str) -> list[int]:
        if len(piece) < self.MIN_CHARS:
            return self.tokenizer.encode(piece, add_special_tokens=False).ids  # type: ignore[no-any-return]
        with self.lock:  # the event loop's thread and the tokenizer's worker both come here
            known = self.pieces.get(piece)
            if known is not None:
                self.pieces.move_to_end(piece)
                self.hits += 1
                return known
        ids: list[int] = self.tokenizer.encode(piece, add_special_tokens=False).ids
        with self.lock:
            self.misses += 1
            if piece not in self.pieces:
                self.pieces[piece] = ids
                self.chars += len(piece)
            while self.chars > self.BUDGET_CHARS:
                old, _ = self.pieces.popitem(last=False)
                self.chars -= len(old)
        return ids


def _raise(message: str) -> None:
    raise ValueError(message)
