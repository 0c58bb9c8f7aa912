"""Prefix keys: stable under extension, separated by model/adapter/salt, bounded, ASCII fast path consistent."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.prefix.hashing import DEFAULT_BLOCK_CHARS, IndexKey, PrefixHasher, prefix_keys, prefix_seed

texts = st.text(min_size=0, max_size=600)
block_sizes = st.integers(min_value=1, max_value=80)


@settings(max_examples=200, deadline=None)
@given(base=texts, extra=texts, block=block_sizes)
def test_extension_shares_leading_full_block_keys(base: str, extra: str, block: int) -> None:
    seed = prefix_seed("m")
    short = prefix_keys(base, seed, block, 10_000)
    long = prefix_keys(base + extra, seed, block, 10_000)
    full = len(base) // block
    assert long[:full] == short[:full]
    assert len(short) == -(-len(base) // block)  # last partial block included


@settings(max_examples=200, deadline=None)
@given(a=texts, b=texts, block=block_sizes)
def test_keys_differ_after_first_differing_block(a: str, b: str, block: int) -> None:
    seed = prefix_seed("m")
    ka, kb = prefix_keys(a, seed, block, 10_000), prefix_keys(b, seed, block, 10_000)
    for i, (x, y) in enumerate(zip(ka, kb, strict=False)):
        same_text = a[: (i + 1) * block] == b[: (i + 1) * block]
        assert (x == y) == same_text  # 64-bit collisions are not expected in a few hundred examples


@settings(max_examples=100, deadline=None)
@given(text=st.text(min_size=1, max_size=400), m1=st.text(max_size=20), m2=st.text(max_size=20))
def test_model_seed_changes_every_key(text: str, m1: str, m2: str) -> None:
    if m1 == m2:
        return
    k1 = prefix_keys(text, prefix_seed(m1), 16)
    k2 = prefix_keys(text, prefix_seed(m2), 16)
    assert all(x != y for x, y in zip(k1, k2, strict=True))


def test_adapter_and_salt_separate_chains() -> None:
    text = "s" * 300
    keys = {
        tuple(prefix_keys(text, prefix_seed("base"))),
        tuple(prefix_keys(text, prefix_seed("base", adapter="sql"))),
        tuple(prefix_keys(text, prefix_seed("base", cache_salt="tenant-a"))),
        tuple(prefix_keys(text, prefix_seed("base", adapter="sql", cache_salt="tenant-a"))),
    }
    assert len(keys) == 4
    # No aliasing through the separator: ("a", "b") must not equal ("a\x00b", None) in effect.
    assert prefix_seed("ab", "c") != prefix_seed("a", "bc")


def test_max_blocks_caps_and_empty_prompt() -> None:
    seed = prefix_seed("m")
    assert prefix_keys("", seed) == []
    keys = prefix_keys("x" * 100_000, seed, 64, 256)
    assert len(keys) == 256
    assert keys == prefix_keys("x" * (64 * 256), seed, 64, 256)


def test_ascii_and_unicode_paths_agree_on_shared_blocks() -> None:
    seed = prefix_seed("m")
    ascii_text = "a" * 128
    mixed = ascii_text + "é" * 10
    assert prefix_keys(mixed, seed, 64)[:2] == prefix_keys(ascii_text, seed, 64)
    assert prefix_keys("\ud800x", seed, 1)  # lone surrogates from JSON do not raise


def test_hasher_block_geometry() -> None:
    assert PrefixHasher().block_chars(None) == DEFAULT_BLOCK_CHARS
    assert PrefixHasher().block_chars(128) == 512
    assert PrefixHasher(block_chars=100).block_chars(128) == 100
    h = PrefixHasher(max_blocks=3)
    assert len(h.keys("z" * 10_000, "m", block_size_tokens=16)) == 3
    with pytest.raises(ValueError):
        PrefixHasher(block_chars=0)
    with pytest.raises(ValueError):
        prefix_keys("abc", 1, 0)


def test_an_index_key_keys_the_chain_root_and_session_ids(tmp_path: Path) -> None:
    plain, keyed = IndexKey(), IndexKey(b"0123456789abcdef-secret")
    assert plain.seed("m", None, "salt") == prefix_seed("m", None, "salt")  # unkeyed: the figures stay as they were
    assert keyed.seed("m", None, "salt") != plain.seed("m", None, "salt")
    assert keyed.seed("m") == IndexKey(b"0123456789abcdef-secret").seed("m")  # replicas with one key agree
    assert "sess-1" not in keyed.session("sess-1") and keyed.session("sess-1") != plain.session("sess-1")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        IndexKey(b"short")
    (tmp_path / "key").write_text("  0123456789abcdef-secret\n")
    assert IndexKey.from_file(str(tmp_path / "key")).seed("m") == keyed.seed("m")
    with pytest.raises(ValueError, match="missing"):
        IndexKey.from_file(str(tmp_path / "missing"))
