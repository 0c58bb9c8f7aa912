"""Prefix-cache awareness: chained block keys of a prompt and an index of which endpoint holds which blocks."""

from picker.prefix.hashing import PrefixHasher, prefix_keys, prefix_seed
from picker.prefix.index import PrefixIndex
from picker.prefix.memory import InMemoryPrefixIndex

__all__ = ["InMemoryPrefixIndex", "PrefixHasher", "PrefixIndex", "prefix_keys", "prefix_seed"]
