"""The local tokenizer (`--tokenizer DIR`): a model directory's tokenizer.json and chat template give the token
ids vLLM would (the template rendered with add_generation_prompt, then tokenized without added special tokens;
completions with them); a directory that cannot be used is a start-up error naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from picker.core.requests import build_request, tokenize_input
from picker.prefix.tokens import LocalTokenizer, TokenizerFilesError

TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE tokenizer trained here (no hub), with a Llama-3-style template and BOS added to plain text."""
    root = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|unk|>", *SPECIALS])
    text = ["the quick brown fox jumps over the lazy dog " * 3, "system prompts and user questions " * 4]
    tokenizer.train_from_iterator(text * 50, trainer)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}, "chat_template": TEMPLATE}))
    return root


def rendered_input(body: dict[str, object], path: str) -> dict[str, object]:
    request = build_request({":path": path, ":method": "POST"}, json.dumps(body).encode(), request_id="r")
    given = tokenize_input(request)
    assert given is not None
    return given


def test_chat_is_rendered_with_the_template_and_tokenized_as_vllm_does(model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    messages = [{"role": "system", "content": "the lazy dog "}, {"role": "user", "content": [
        {"type": "text", "text": "quick brown fox"}]}]
    expected = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nthe lazy dog<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nquick brown fox<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = local.ids(rendered_input({"model": "m", "messages": messages}, "/v1/chat/completions"))
    assert ids == raw.encode(expected, add_special_tokens=False).ids
    assert ids is not None and ids[0] == raw.token_to_id("<|begin_of_text|>") and ids.count(ids[0]) == 1
    # Anthropic's system prompt goes first, as a system turn
    anthropic = local.ids(rendered_input({"model": "m", "system": "the lazy dog", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "quick brown fox"}]},
                                         "/v1/messages"))
    assert anthropic == ids


def test_completions_get_the_tokenizers_special_tokens_and_token_ids_pass_through(model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = local.ids(rendered_input({"model": "m", "prompt": "the quick brown fox"}, "/v1/completions"))
    assert text == raw.encode("the quick brown fox", add_special_tokens=True).ids and text[0] == 1
    assert local.ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert local.ids({"prompt": ["two", "prompts"]}) is None  # a batch: not routed precisely


def test_a_directory_that_cannot_be_used_is_refused(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="no tokenizer.json"):
        LocalTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerFilesError):
        LocalTokenizer(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    (broken / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerFilesError, match="chat template"):
        LocalTokenizer(broken)
    result = subprocess.run([sys.executable, "-m", "picker", "serve", "--endpoints", "127.0.0.1:1",
                             "--kv-events-endpoint", "tcp://127.0.0.1:1", "--tokenizer", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "tokenizer:" in result.stderr and "Traceback" not in result.stderr


def test_a_shared_system_prompt_is_tokenized_once_and_the_ids_stay_exact(model_dir: Path) -> None:
    import random

    local = LocalTokenizer(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(5)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "system", "prompts", "and", "user", "questions"]
    system = " ".join(rng.choice(words) for _ in range(200))
    for i in range(20):
        question = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 80)))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = ("<|begin_of_text|>" + "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
                                             f"{m['content'].strip()}<|eot_id|>" for m in messages)
                + "<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert local.ids({"messages": messages}) == raw.encode(text, add_special_tokens=False).ids, i
    assert local.segments.misses >= 1 and local.segments.hits >= 19


async def test_a_large_prompt_is_tokenized_off_the_event_loop_with_the_same_ids(model_dir: Path) -> None:
    local = LocalTokenizer(model_dir)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "the quick brown fox " * 2000}]}
        request = build_request({":path": "/v1/chat/completions", ":method": "POST"}, json.dumps(body).encode(),
                                request_id="big")
        given = tokenize_input(request)
        assert request.body_bytes > 16 << 10 and given is not None
        assert await local.token_ids(request, list) == local.ids(given)
    finally:
        await local.close()
