"""Prefix sources: what a request's cycle state learns of the pods' caches before any filter or scorer reads it.

Each producer writes typed fields of the `SchedulingContext` (the block width, the prompt's keys, how many blocks
each pod holds) and learns from the pick; the scheduler runs them in order and knows none of them. The approximate
index comes first (every pod gets a match from our own picks); the precise view then overwrites the match of
the pods whose KV events it trusts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from picker.core.requests import InferenceRequest
from picker.endpoints.state import Endpoint
from picker.prefix.chars_per_token import CharsPerToken
from picker.prefix.hashing import PrefixHasher, prefix_keys
from picker.prefix.index import PrefixIndex
from picker.prefix.precise import PrecisePrefix
from picker.scheduling.context import SchedulingContext, effective_model


class PrefixProducer(Protocol):
    """Fills a request's prefix state before scoring and learns where it went."""

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        """Write what this source knows of the request's prefix on `endpoints` into `ctx` (a prompt is there)."""
        ...

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        """The request went to `endpoint`."""
        ...

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        """The pod left the pool, or its cache is presumed lost."""
        ...


class ApproximatePrefix:
    """The prompt's chained character-block keys matched in the prefix index (which pods probably hold how much
    of it, learned from our own picks), and each pod's share of the index sized from its cache at the traffic's
    learned characters per token."""

    def __init__(self, index: PrefixIndex, hasher: PrefixHasher) -> None:
        self.index = index
        self.hasher = hasher
        # what the traffic's prompts really are in tokens: sizes each pod's share of the index from its cache
        self.chars_per_token = CharsPerToken(hasher.chars_per_token)
        self._next_sweep = -float("inf")

    def keys(self, request: InferenceRequest, block_chars: int) -> list[int]:
        seed = self.hasher.key.seed(effective_model(request), None, request.cache_salt)
        return prefix_keys(request.prompt_text, seed, block_chars, self.hasher.max_blocks)

    def block_chars(self, endpoints: Sequence[Endpoint]) -> int:
        """Block width from the first pod that reports its cache block size (pods of a pool share it)."""
        for endpoint in endpoints:
            size = endpoint.metrics.block_size
            if size:
                return self.hasher.block_chars(size)
        return self.hasher.block_chars(None)

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        ctx.block_chars = self.block_chars(endpoints)
        ctx.keys = self.keys(ctx.request, ctx.block_chars)
        ctx.matches = self.index.match(ctx.keys, None, now)

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        if not ctx.keys:
            return
        request = ctx.request
        self.chars_per_token.picked(endpoint, len(request.prompt_text))
        capacity = self._capacity_blocks(endpoint, ctx.block_chars)
        if capacity:
            self.index.set_capacity(endpoint.address, capacity)
        self.index.record(ctx.keys, endpoint.address, now, prompt_chars=len(request.prompt_text),
                          session_id=ctx.session)
        if now >= self._next_sweep:
            self._sweep(now)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        self.index.remove_endpoint(endpoint.address)
        self.chars_per_token.forget(endpoint.address)

    def _sweep(self, now: float) -> None:
        """Free expired entries now and then (matches already ignore them) for backends that can sweep."""
        ttl = self.index.ttl
        if not ttl:
            self._next_sweep = float("inf")
            return
        self.index.expire(now)
        self._next_sweep = now + ttl / 4

    def _capacity_blocks(self, endpoint: Endpoint, block_chars: int) -> int | None:
        """The pod's KV cache in our blocks: num_gpu_blocks x block_size tokens, re-cut into `block_chars` at the
        traffic's learned characters per token."""
        m = endpoint.metrics
        if not m.num_gpu_blocks:
            return None
        if not m.block_size:
            return m.num_gpu_blocks
        return max(1, int(m.num_gpu_blocks * m.block_size * self.chars_per_token.value) // block_chars)


class PreciseOverlay:
    """The pods' KV events (the precise view): for each pod it vouches for, what its cache really holds of the
    prompt's tokens replaces the approximate match, in the approximate index's blocks (tokens x chars per token /
    block width) so every scorer reads it the same way. Needs the prompt's token ids (tokenized before)."""

    def __init__(self, precise: PrecisePrefix, hasher: PrefixHasher) -> None:
        self.precise = precise
        self.hasher = hasher

    def produce(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], now: float) -> None:
        tokens = ctx.request.token_ids
        if not tokens:
            return
        keys, held = self.precise.matches(tokens, ctx.model, endpoints, now, ctx.request.cache_salt)
        if not keys:
            return
        ctx.precise_keys = keys
        ctx.precise_pods = frozenset(held)
        chars_per_token, width, most = self.hasher.chars_per_token, ctx.block_chars, len(ctx.keys)
        matches = ctx.matches
        for address, n in held.items():
            blocks = min(most, n * chars_per_token // width)
            if blocks:
                matches[address] = blocks
            else:
                matches.pop(address, None)

    def on_picked(self, ctx: SchedulingContext, endpoint: Endpoint, now: float) -> None:
        if ctx.precise_keys:
            self.precise.picked(ctx.precise_keys, endpoint.address, now)

    def on_endpoint_removed(self, endpoint: Endpoint) -> None:
        return None  # the view follows the pod's own events (AllBlocksCleared), not the pool
