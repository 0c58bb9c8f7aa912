"""The upper bound of prefix caching: every block ever computed stays cached forever, on one shared cache.

Fed in send order with the same token ids the pods see, it says what hit rate no router can beat: the rest is
first-time prefill. Blocks of a finished request's output count too (vLLM caches them).
"""

from __future__ import annotations

from collections.abc import Sequence


def extend_keys(keys: list[int], token_ids: Sequence[int], block_size: int) -> None:
    """Append chained keys of the full blocks of `token_ids` not keyed yet. Python's tuple hash is enough here
    (one process, equality of prefixes only) and ~10x cheaper than the simulator's block hash."""
    parent = keys[-1] if keys else 0
    for i in range(len(keys), len(token_ids) // block_size):
        parent = hash((parent, *token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent)


class InfiniteCacheOracle:
    """Hit tokens per request against an unbounded block-hash set (vLLM semantics: full blocks only, never the
    last prompt token)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[int] = set()
        self.queries = 0
        self.hits = 0

    def on_send(self, token_ids: Sequence[int]) -> list[int]:
        """Count the hit of a request being sent; returns its block hashes (to extend at finish)."""
        hashes: list[int] = []
        extend_keys(hashes, token_ids, self.block_size)
        limit = (len(token_ids) - 1) // self.block_size
        seen = self.seen
        n = 0
        for h in hashes[:limit]:
            if h not in seen:
                break
            n += 1
        self.queries += len(token_ids)
        self.hits += n * self.block_size
        seen.update(hashes)
        return hashes

    def on_finish(self, hashes: list[int], all_token_ids: Sequence[int]) -> None:
        """Add the full blocks of prompt + output (all but the last token, whose KV is never computed)."""
        extend_keys(hashes, all_token_ids[:-1], self.block_size)
        self.seen.update(hashes)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
