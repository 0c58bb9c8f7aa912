"""Fuzzy prefix affinity (`fuzzy-prefix-scorer`, opt-in): MinHash-LSH over a prompt's leading window, consulted
only when exact prefix matching finds nothing, as a hint of which pod served a similar prompt.

A prompt's leading `windowChars` are cut into shingles of `shingleWords` words; each shingle is hashed (BLAKE2b,
so every process and run agrees) and `bands` x `rows` multiply-shift hash functions keep their minimum: the MinHash
signature, whose equal entries estimate the two prompts' Jaccard similarity. The signature is cut into bands; two
prompts sharing a band are candidates (LSH). The scorer remembers, per band value, the pod that last took a prompt
with it, and scores each candidate pod by the share of the request's bands that point at it.

Why opt-in: a model server's prefix cache is exact. A prompt that differs from another in its first block (a
timestamp on the first line) shares no cached block with it on any pod, so sending it to the pod that served the
similar prompt saves nothing; where prompts differ later, exact matching already finds the shared part and this
scorer stays silent. `bench/fuzzy_prefix.py` measures both cases (README, "Fuzzy prefix matching").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import Field

from picker.core.schema import Section
from picker.endpoints.state import Endpoint
from picker.scheduling.context import SchedulingContext
from picker.scheduling.memory import PodMemory
from picker.scheduling.plugins import Plugin, PluginDeps, PluginFactory, default_of


class MinHasher:
    """MinHash signatures of a text's leading window, `bands` x `rows` long."""

    def __init__(self, bands: int, rows: int, window_chars: int, shingle_words: int, seed: int = 1) -> None:
        self.bands, self.rows = bands, rows
        self.window_chars, self.shingle_words = window_chars, shingle_words
        rng = np.random.default_rng(seed)
        # h(x) = (a x + b mod 2^64) >> 32 with a odd: a multiply-shift family (a mod-p family on 32-bit inputs
        # left the permutations so alike that near-duplicates shared a fraction of the bands they should)
        self._a = rng.integers(0, 1 << 63, size=bands * rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 1 << 63, size=bands * rows, dtype=np.uint64)

    def shingles(self, text: str) -> np.ndarray:
        words = text[: self.window_chars].split()
        k = self.shingle_words
        pieces = [" ".join(words[i:i + k]) for i in range(max(1, len(words) - k + 1))] if words else []
        return np.fromiter((int.from_bytes(hashlib.blake2b(p.encode(), digest_size=8).digest(), "little")
                            for p in pieces), dtype=np.uint64, count=len(pieces))

    def band_keys(self, text: str) -> list[int]:
        """One key per band (empty for a text without words): equal keys, similar leading windows."""
        hashed = self.shingles(text)
        if not len(hashed):
            return []
        with np.errstate(over="ignore"):  # wrapping mod 2^64 is the point
            signature = ((np.outer(self._a, hashed) + self._b[:, None]) >> np.uint64(32)).min(axis=1)
        rows = signature.reshape(self.bands, self.rows)
        return [hash((band, *row.tolist())) for band, row in enumerate(rows)]


class FuzzyPrefixScorer(Plugin):
    type_name = "fuzzy-prefix-scorer"
    needs_prefix = True  # silent when the exact match found something

    def __init__(self, name: str | None = None, *, bands: int = 8, rows: int = 4, window_chars: int = 2048,
                 shingle_words: int = 4, max_keys: int = 200_000) -> None:
        super().__init__(name)
        self.hasher = MinHasher(bands, rows, window_chars, shingle_words)
        self._pods: PodMemory[int] = PodMemory(max_keys)  # band key -> the pod that last took a prompt with it

    def _keys(self, ctx: SchedulingContext) -> list[int]:
        """The request's band keys, computed once (scoring and the pick both need them)."""
        state = ctx.state
        if state is None:
            state = ctx.state = {}
        keys = state.get(self.name)
        if keys is None:
            keys = state[self.name] = self.hasher.band_keys(ctx.request.prompt_text)
        return keys  # type: ignore[return-value]

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint]) -> list[float]:
        if any(ctx.matched) or not self._pods:
            return [0.0] * len(candidates)
        keys = self._keys(ctx)
        if not keys:
            return [0.0] * len(candidates)
        votes: dict[str, int] = {}
        get = self._pods.get
        for key in keys:
            address = get(key)
            if address is not None:
                votes[address] = votes.get(address, 0) + 1
        if not votes:
            return [0.0] * len(candidates)
        bands = len(keys)
        return [votes.get(e.address, 0) / bands for e in candidates]

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        remember = self._pods.remember
        for key in self._keys(ctx):
            remember(key, endpoint.address)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self._pods.forget_pod(endpoint.address)


class FuzzyPrefixParams(Section):
    bands: int = Field(default_of(FuzzyPrefixScorer, "bands"), gt=0, le=64)
    rows: int = Field(default_of(FuzzyPrefixScorer, "rows"), gt=0, le=16)
    window_chars: int = Field(default_of(FuzzyPrefixScorer, "window_chars"), gt=0)
    shingle_words: int = Field(default_of(FuzzyPrefixScorer, "shingle_words"), gt=0)
    max_keys: int = Field(default_of(FuzzyPrefixScorer, "max_keys"), gt=0)


def _fuzzy(name: str, p: FuzzyPrefixParams, deps: PluginDeps) -> Plugin:
    return FuzzyPrefixScorer(name, **p.model_dump())


FACTORIES: tuple[PluginFactory[Any], ...] = (
    PluginFactory(FuzzyPrefixScorer.type_name, FuzzyPrefixParams, _fuzzy),
)
