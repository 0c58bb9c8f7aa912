"""A small multimodal model for the real vLLM on the CPU: a random-weight Idefics3, built here (no model hub).

Idefics3 is the architecture of Idefics3-8B and of SmolVLM (a SigLIP vision tower, pixel shuffle, a Llama text
model); transformers' Idefics3 processor has a PIL backend, and vLLM 0.32's implementation imports nothing
else that is missing here. Qwen2-VL and its successors, the layout the picker assumes by default, cannot run:
vLLM 0.32's `qwen2_vl.py` imports `smart_resize` from transformers' torchvision image processor, and the package
registry has only CUDA builds of torchvision, which fail to load beside the CPU build of torch ("operator
torchvision::nms does not exist"). Heads of 64 dimensions, as for the text model (vLLM's CPU attention kernels),
and the processor's defaults: images resized to a 1,456-pixel longest side, tiles of 364 pixels, 169 tokens each.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from picker_lab.bench.vllm_engine import OUT, VOCAB, run_logged, venv_python

MODEL_DIR = OUT / "tiny-idefics3"
MAX_MODEL_LEN = 16384  # an image is up to 2,913 tokens here; a few per prompt
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32 for this model's layers

BUILD_IDEFICS3 = textwrap.dedent(
    """
    import random, sys
    from pathlib import Path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    out, vocab, max_len = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    specials = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    corpus = (" ".join(rng.choice(words) for _ in range(40)) + "." for _ in range(20000))
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = (
        "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] in ['image', 'image_url'] %}<image>"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<end_of_utterance>\\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<end_of_utterance>", pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        extra_special_tokens={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                              "end_of_utterance_token": "<end_of_utterance>"})
    fast.chat_template = template
    fast.model_max_length = max_len
    ids = {s: tok.token_to_id(s) for s in specials}
    config = Idefics3Config(
        vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                           image_size=364, patch_size=14),
        text_config=dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_len, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=ids["<end_of_utterance>"], bos_token_id=ids["<|endoftext|>"]),
        scale_factor=2, image_token_id=ids["<image>"], pad_token_id=0, tie_word_embeddings=True,
        torch_dtype="float32")
    Idefics3ForConditionalGeneration(config).save_pretrained(out)
    Idefics3Processor(image_processor=Idefics3ImageProcessorPil(), tokenizer=fast, image_seq_len=169,
                      chat_template=template).save_pretrained(out)
    print("built", out, "vocab", tok.get_vocab_size())
    """
)


def build_media_model() -> Path:
    """The random-weight Idefics3 and its processor (kept between runs: same seed, same model)."""
    if (MODEL_DIR / "config.json").exists() and (MODEL_DIR / "processor_config.json").exists():
        return MODEL_DIR
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    script = MODEL_DIR.parent / "build_idefics3.py"
    script.write_text(BUILD_IDEFICS3)
    run_logged([str(venv_python()), str(script), str(MODEL_DIR), str(VOCAB), str(MAX_MODEL_LEN)])
    return MODEL_DIR
