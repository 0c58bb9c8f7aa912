"""Stand-in tokenizer, chat template, output words, profiles and the `picker sim` command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from picker_lab.sim.profiles import PROFILES, get_profile
from picker_lab.sim.tokenizer import PseudoWords, Tokenizer, render_chat

ENGLISH = (
    "Routing quality must be measured on a simulated fleet that behaves like vLLM where routing matters. "
    "The picker sends each request to the pod that already holds the longest prefix of its prompt in cache, "
    "unless that pod is overloaded; then it balances load across the remaining candidates."
)


def test_about_four_characters_per_token_and_stable_ids() -> None:
    tok = Tokenizer(128_256)
    ids = tok.encode(ENGLISH, add_special_tokens=False)
    chars_per_token = len(ENGLISH) / len(ids)
    assert 3.0 <= chars_per_token <= 5.0
    assert Tokenizer(128_256).encode(ENGLISH) == tok.encode(ENGLISH)  # no per-process randomness
    assert all(0 <= t < 128_256 for t in ids)
    assert tok.encode("hello")[0] == tok.bos_token_id
    # a shared text prefix gives a shared token prefix (up to the word that differs)
    a = tok.encode(ENGLISH + " first tail")
    b = tok.encode(ENGLISH + " other tail")
    assert a[: len(ids)] == b[: len(ids)]


_SPECIAL = re.compile(r"(<\|(?:begin_of_text|end_of_text|start_header_id|end_header_id|eot_id)\|>)")
_WORD_PIECES = re.compile(r" ?[^\W_]+| ?[^\s\w]+| ?_+|\s+")


def reference_pieces(text: str) -> list[str]:
    """The documented algorithm, written plainly: cut out special tokens, split the rest into word pieces (leading
    space attached), chop each piece into 4-character chunks."""
    out: list[str] = []
    for i, segment in enumerate(_SPECIAL.split(text)):
        if i % 2:
            out.append(segment)
            continue
        for piece in _WORD_PIECES.findall(segment):
            out.extend(piece[k : k + 4] for k in range(0, len(piece), 4))
    return out


@settings(max_examples=500, deadline=None)
@example("     a")
@example(" ....<|eot_id|>")
@example("x\n\n\n\n\n  y")
@given(st.lists(st.sampled_from(list("ab_ .,!\n\t\u00e9\u4e2d1") + ["<|eot_id|>", "<|x|>"]), max_size=60).map("".join))
def test_fast_tokenizer_equals_the_documented_algorithm(text: str) -> None:
    tok = Tokenizer(4096)
    assert tok.pieces(text) == reference_pieces(text)
    assert "".join(tok.pieces(text)) == text  # lossless split


def test_chat_template_renders_like_llama3() -> None:
    text = render_chat([{"role": "system", "content": "  be brief "}, {"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}])  # fmt: skip
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi\nthere<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = Tokenizer(4096).encode(text, add_special_tokens=False)
    assert ids[:2] == [1, 3] and ids[-2] == 4  # BOS, <|start_header_id|> ... <|end_header_id|>, "\n\n"
    with pytest.raises(ValueError):
        render_chat([{"content": "no role"}])


def test_generated_words_retokenize_to_the_generated_ids() -> None:
    tok = Tokenizer(4096)
    words = PseudoWords(tok)
    out = [words.token(12345, i) for i in range(50)]
    assert tok.encode(words.decode(out), add_special_tokens=False) == out
    assert len(set(words.ids)) == len(words.ids) >= 512


def test_profiles_are_consistent() -> None:
    for p in PROFILES.values():
        assert p.usable_blocks() * p.block_size >= p.max_model_len  # one max-length request fits
        assert p.max_num_batched_tokens >= p.block_size
    tiny = get_profile("tiny-cpu")
    assert (tiny.block_size, tiny.num_gpu_blocks) == (128, 8192)
    with pytest.raises(ValueError):
        get_profile("nope")
    with pytest.raises(ValueError):
        tiny.with_overrides(not_a_field=1)


def test_cli_starts_pods_prints_urls_and_stops_on_sigterm() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "picker.cli", "sim", "--pods", "3", "--base-port", "0", "--profile", "tiny-cpu",
         "--time-scale", "10", "--lora-modules", "a=/x"],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        urls = [line.split()[1] for line in lines]
        assert [line.split()[0] for line in lines] == ["sim-0", "sim-1", "sim-2"]
        for url in urls:
            assert url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                assert b'"a"' in resp.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
