"""A prompt's token ids, for precise prefix routing: asked of a model server's `POST /tokenize`.

The pod renders chat messages with its own chat template and tokenizes with its own tokenizer, so the ids are
exactly those it will cache (vLLM and `picker sim` both serve `/tokenize`; vLLM applies the template with
`add_generation_prompt`, as for a chat completion). A completions prompt given as token ids needs no call. The
call is bounded (`timeout`, default 100 ms) and never fails a request: without ids the request is routed on the
approximate index. What it costs the pod is one tokenization per request in its API server
(bench/README.md has the figures).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp

from picker.endpoints.state import Endpoint
from picker.requests import InferenceRequest

log = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    async def token_ids(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[int] | None:
        """The prompt's token ids, or None (then the approximate index routes the request)."""
        ...


def given_token_ids(prompt: Any) -> list[int] | None:
    """A completions prompt that is already token ids (one list of ints)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


class PodTokenizer:
    """`POST /tokenize` on the least busy candidate (the pods of a model share its tokenizer)."""

    def __init__(self, *, timeout: float = 0.1, scheme: str = "http") -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.scheme = scheme
        self._session: aiohttp.ClientSession | None = None
        self.calls = 0
        self.failures = 0

    async def token_ids(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[int] | None:
        given = request.tokenize_input
        if given is None or not candidates:
            return None
        direct = given_token_ids(given.get("prompt"))
        if direct is not None:
            return direct
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        pod = min(candidates, key=lambda e: e.in_flight)
        body = json.dumps({"model": request.target_model or request.model, **given}).encode()
        self.calls += 1
        try:
            async with self._session.post(f"{self.scheme}://{pod.address}/tokenize", data=body, timeout=self.timeout,
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
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
