"""Prefix keys: the prompt cut into fixed-size character blocks, each key a 64-bit xxh3 chained over its parent.

Chaining makes key i stand for the whole prefix up to block i, so two prompts share key i exactly when they
share their first i+1 blocks — what a KV cache can reuse. Characters (not tokens) keep this free of a
tokenizer: ~4 characters per token, so a block of `block_size * 4` characters tracks one vLLM cache block.
"""

from __future__ import annotations

from hashlib import blake2b
from pathlib import Path

from xxhash import xxh3_64_intdigest

from picker.core.requests import CHARS_PER_TOKEN

DEFAULT_BLOCK_CHARS = 16 * CHARS_PER_TOKEN  # vLLM GPU block size 16 tokens (GIE's 64 characters)
DEFAULT_MAX_PREFIX_BLOCKS = 256


def prefix_seed(model: str, adapter: str | None = None, cache_salt: str | None = None) -> int:
    """Chain root for one (model, LoRA adapter, cache_salt): vLLM never shares cache blocks across these."""
    material = f"{model}\x00{adapter or ''}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return xxh3_64_intdigest(material)


def prefix_keys(
    text: str,
    seed: int,
    block_chars: int = DEFAULT_BLOCK_CHARS,
    max_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
) -> list[int]:
    """Chained keys of `text`'s blocks (last partial block included), at most `max_blocks` of them.

    Each key is xxh3_64(block bytes, seed=parent key): the 64-bit seed carries the chain without
    concatenating buffers. ASCII text is encoded once and sliced (the same bytes as encoding each block,
    so a prompt's keys do not depend on whether later text is ASCII).
    """
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    end = min(len(text), block_chars * max_blocks)
    parent = seed
    if text.isascii():
        data = text[:end].encode("ascii")
        return [parent := xxh3_64_intdigest(data[i : i + block_chars], parent) for i in range(0, end, block_chars)]
    return [
        parent := xxh3_64_intdigest(text[i : min(i + block_chars, end)].encode("utf-8", "surrogatepass"), parent)
        for i in range(0, end, block_chars)
    ]


MIN_KEY_BYTES = 16


class IndexKey:
    """The secret the replicas share (`--index-hash-key-file`) so that what lands in Redis tells nothing to whoever
    reads it: each chain's root is a BLAKE2b MAC of (model, adapter, cache_salt) under the secret, so no block key
    of a guessed prompt can be computed without it (the chain after the root stays xxh3: fast, and every link
    depends on the keyed root); session ids are stored as their BLAKE2b MAC, never as sent. Without a secret the
    root is the plain xxh3 of the same material (one replica, or an index nobody else can read)."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes = b"") -> None:
        if secret and len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"an index hash key needs at least {MIN_KEY_BYTES} bytes, not {len(secret)}")
        # BLAKE2b takes keys of up to 64 bytes: a longer secret is hashed down
        self._secret = secret if len(secret) <= 64 else blake2b(secret, digest_size=32).digest()

    @classmethod
    def from_file(cls, path: str) -> IndexKey:
        """The key in a file (a mounted Secret: surrounding whitespace ignored); ValueError naming the file."""
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or exc}") from None
        try:
            return cls(secret)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @property
    def keyed(self) -> bool:
        return bool(self._secret)

    def seed(self, model: str, adapter: str | None = None, cache_salt: str | None = None) -> int:
        if not self._secret:
            return prefix_seed(model, adapter, cache_salt)
        material = f"{model}\x00{adapter or ''}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")
        return int.from_bytes(blake2b(material, key=self._secret, digest_size=8).digest(), "little")

    def session(self, session_id: str) -> str:
        """What a session id is remembered (and shared) as: its MAC, so Redis holds no session id in clear."""
        return blake2b(session_id.encode("utf-8", "surrogatepass"), key=self._secret, digest_size=16).hexdigest()


class PrefixHasher:
    """Prefix keys with fixed block geometry; `block_chars=None` derives it from the pods' block size."""

    __slots__ = ("_block_chars", "max_blocks", "chars_per_token", "key", "default_block_chars")

    def __init__(
        self,
        block_chars: int | None = None,
        max_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
        chars_per_token: int = CHARS_PER_TOKEN,
        key: IndexKey | None = None,
        default_block_chars: int = DEFAULT_BLOCK_CHARS,
    ) -> None:
        self.key = key if key is not None else IndexKey()
        if default_block_chars <= 0:
            raise ValueError("default_block_chars must be positive")
        self.default_block_chars = default_block_chars
        if block_chars is not None and block_chars <= 0:
            raise ValueError("block_chars must be positive")
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self._block_chars = block_chars
        self.max_blocks = max_blocks
        self.chars_per_token = chars_per_token

    def block_chars(self, block_size_tokens: int | None) -> int:
        """Configured block width, else the pods' block size in tokens x chars/token, else the default (64)."""
        if self._block_chars is not None:
            return self._block_chars
        if block_size_tokens:
            return block_size_tokens * self.chars_per_token
        return self.default_block_chars

    def keys(
        self,
        text: str,
        model: str,
        adapter: str | None = None,
        cache_salt: str | None = None,
        block_size_tokens: int | None = None,
    ) -> list[int]:
        return prefix_keys(
            text, self.key.seed(model, adapter, cache_salt), self.block_chars(block_size_tokens), self.max_blocks
        )
