"""Turn trace requests into what each side sees: the pod's token ids, the picker's prompt text, an HTTP body.

Fast mode tokenizes 100k prompts, so token ids are built from per-text caches: the simulator's chat template
puts a special token around every message, and the tokenizer never merges pieces across a special token or a
newline, so the ids of a whole prompt are the concatenation of the ids of its parts. `tests/test_bench_workloads.py`
checks this against `picker_lab.sim.openai_api.chat_prompt` and `Tokenizer.encode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from picker.core.requests import render_messages
from picker_lab.bench.trace import Message, TraceRequest
from picker_lab.sim.tokenizer import END_HEADER, EOT, SPECIAL_TOKENS, START_HEADER, Tokenizer


class PromptBuilder:
    """Caching renderer for one tokenizer (one vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, max_cache: int = 200_000) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        self._max_cache = max_cache
        self._bos = tokenizer.bos_token_id
        self._start = SPECIAL_TOKENS[START_HEADER]
        self._end = SPECIAL_TOKENS[END_HEADER]
        self._eot = SPECIAL_TOKENS[EOT]
        self._sep = tokenizer.encode("\n\n", add_special_tokens=False)

    def _ids(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            if len(self._cache) >= self._max_cache:
                self._cache.clear()
            ids = self._cache[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids the simulator's chat template + tokenizer give (generation prompt included)."""
        out = [self._bos]
        for role, content in messages:
            out.append(self._start)
            out += self._ids(role)
            out.append(self._end)
            out += self._sep
            out += self._ids(content.strip())
            out.append(self._eot)
        out.append(self._start)
        out += self._ids("assistant")
        out.append(self._end)
        out += self._sep
        return out

    def completion_ids(self, parts: Sequence[str]) -> list[int]:
        """Token ids of a completions prompt made of `parts` (each part ends at a newline or the end)."""
        out = [self._bos]
        for part in parts:
            out += self._ids(part)
        return out


def prompt_text(messages: Sequence[Message] | None, prompt: Sequence[str] | None) -> str:
    """The canonical text the picker hashes (exactly what `picker.core.requests.build_request` computes)."""
    if prompt is not None:
        return "".join(prompt)
    return render_messages([{"role": r, "content": c} for r, c in messages or ()])


def http_body(model: str, req: TraceRequest, messages: Sequence[Message] | None) -> dict[str, Any]:
    """The streaming OpenAI request body for live mode (output length fixed: ignore_eos)."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if req.prompt is not None:
        body["prompt"] = "".join(req.prompt)
    else:
        body["messages"] = [{"role": r, "content": c} for r, c in messages or ()]
    return body
