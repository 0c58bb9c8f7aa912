"""Deterministic, fast stand-in tokenizer, a Llama-3-style chat template and pseudo-word output text.

Why not a real tokenizer: the simulator must tokenize ~10k requests/s on two cores and be reproducible without
model files. What routing needs is that equal text gives equal token ids and that token counts are realistic
(~4 characters per token on English), so: split text into word pieces (a leading space glued to the word, runs of
punctuation, runs of whitespace), chop pieces longer than 4 characters into 4-character chunks, and map each piece
to `RESERVED + hash(piece) mod (vocab - RESERVED)`. Special tokens of the chat template are single ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS: dict[str, int] = {BOS: 1, EOS: 2, START_HEADER: 3, END_HEADER: 4, EOT: 5}
RESERVED_IDS = 256  # ids below this are special/reserved, like the added tokens of real vocabularies
CHUNK_CHARS = 4

# Special tokens are cut out first; in the text between them one regex yields the final pieces: a word, punctuation
# or underscore run with an optional leading space, cut into chunks of at most 4 characters (the leading space
# counts), else up to 4 whitespace characters.
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
# (A whitespace char right after whitespace continues a run, so a long run is cut into 4-char chunks and its last
# space is not glued to the next word.)
_PIECES = re.compile(
    r"(?<=\s)\s{1,4}| [^\W_]{1,3}|[^\W_]{1,4}| [^\s\w]{1,3}|[^\s\w]{1,4}| _{1,3}|_{1,4}|\s{1,4}"
)


def is_utf8(text: str) -> bool:
    """Whether `text` can be encoded as UTF-8, i.e. holds no lone surrogate (json.loads accepts "\\ud800")."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def split_pieces(text: str) -> list[str]:
    """Pieces of `text` (each maps to one token id)."""
    if "<|" not in text:
        return _PIECES.findall(text)
    out: list[str] = []
    for i, segment in enumerate(_SPECIAL_SPLIT.split(text)):
        if i % 2:
            out.append(segment)
        elif segment:
            out.extend(_PIECES.findall(segment))
    return out


class Tokenizer:
    """Text -> token ids; stable across processes and runs (no Python `hash`)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= RESERVED_IDS + 16:
            raise ValueError(f"vocab_size must exceed {RESERVED_IDS + 16}")
        self.vocab_size = vocab_size
        self._span = vocab_size - RESERVED_IDS
        self._cache: dict[str, int] = {}
        self.bos_token_id = SPECIAL_TOKENS[BOS]
        self.eos_token_id = SPECIAL_TOKENS[EOS]

    def piece_id(self, piece: str) -> int:
        """Token id of one piece of at most CHUNK_CHARS characters (or a special token)."""
        tid = self._cache.get(piece)
        if tid is None:
            special = SPECIAL_TOKENS.get(piece)
            if special is not None:
                tid = special
            else:
                tid = RESERVED_IDS + xxhash.xxh32_intdigest(piece.encode("utf-8", "surrogatepass")) % self._span
            if len(self._cache) > 1_000_000:
                self._cache.clear()
            self._cache[piece] = tid
        return tid

    def pieces(self, text: str) -> list[str]:
        """The string pieces `encode` maps to ids (useful to show `token_strs`)."""
        return split_pieces(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` prepends BOS like Llama tokenizers do for completions."""
        get = self._cache.get
        piece_id = self.piece_id
        ids = [get(p) or piece_id(p) for p in split_pieces(text)]
        if add_special_tokens:
            ids.insert(0, self.bos_token_id)
        return ids


def _content_text(content: Any) -> str:
    """Message content as text: a string, or OpenAI content parts whose text parts are joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif not isinstance(part, Mapping):
                raise ValueError("each content part must be an object or a string")
            elif part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("the text of a text content part must be a string")
                texts.append(text)
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render messages with the Llama-3 chat template (role header, trimmed content, end-of-turn marker)."""
    parts = [BOS]
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError("each message must be an object with a 'role'")
        role = message["role"]
        if not isinstance(role, str):
            raise ValueError("a message's role must be a string")
        text = _content_text(message.get("content")).strip()
        parts.append(f"{START_HEADER}{role}{END_HEADER}\n\n{text}{EOT}")
    if add_generation_prompt:
        parts.append(f"{START_HEADER}assistant{END_HEADER}\n\n")
    return "".join(parts)


# Chat template in Jinja form, written into the tiny model directory by bench/validate_sim.py so the real vLLM
# renders chats with the same structure as render_chat.
LLAMA3_JINJA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


class PseudoWords:
    """Deterministic output text: each output token is one short pseudo-word (" ka", " lom", ...).

    Every word is a single token under `Tokenizer` (a space plus at most 3 letters) with a distinct id, so the text
    the simulator returns re-tokenizes to exactly the token ids it generated and cached.
    """

    def __init__(self, tokenizer: Tokenizer, max_words: int = 1024) -> None:
        texts: list[str] = []
        ids: list[int] = []
        seen: set[int] = set()
        for word in self._candidates():
            text = " " + word
            tid = tokenizer.piece_id(text)
            if tid in seen:
                continue
            seen.add(tid)
            texts.append(text)
            ids.append(tid)
            if len(texts) >= max_words:
                break
        self.texts = texts
        self.ids = ids
        self.text_by_id: dict[int, str] = dict(zip(ids, texts, strict=True))

    @staticmethod
    def _candidates() -> Iterable[str]:
        for c in _CONSONANTS:
            for v in _VOWELS:
                yield c + v
        for c in _CONSONANTS:
            for v in _VOWELS:
                for c2 in _CONSONANTS:
                    yield c + v + c2

    def token(self, stream_key: int, position: int) -> int:
        """Token id at `position` of the output stream identified by `stream_key`."""
        h = xxhash.xxh3_64_intdigest(position.to_bytes(8, "little"), seed=stream_key)
        return self.ids[h % len(self.ids)]

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of generated token ids (unknown ids decode to nothing)."""
        get = self.text_by_id.get
        return "".join(get(t, "") for t in token_ids)
