"""Small multimodal models for the real vLLM on the CPU: a random-weight Idefics3 and Qwen2-Audio, built here (no
model hub).

Idefics3 is the architecture of Idefics3-8B and of SmolVLM (a SigLIP vision tower, pixel shuffle, a Llama text
model); transformers' Idefics3 processor has a PIL backend, and vLLM 0.32's implementation imports nothing
else that is missing here. Qwen2-VL and its successors, the layout the picker assumes by default, cannot run:
vLLM 0.32's `qwen2_vl.py` imports `smart_resize` from transformers' torchvision image processor, and the package
registry has only CUDA builds of torchvision, which fail to load beside the CPU build of torch ("operator
torchvision::nms does not exist"). Qwen2-Audio (a Whisper encoder, a Qwen2 text model) needs vLLM's audio extra
(librosa, soundfile), installed with it. Heads of 64 dimensions, as for the text model (vLLM's CPU attention
kernels), and the processors' defaults: images resized to a 1,456-pixel longest side, tiles of 364 pixels, 169
tokens each; audio at 16 kHz in 30-second windows, 25 tokens a second.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import textwrap
from pathlib import Path

from picker_lab.bench.vllm_engine import (
    OUT,
    TRAIN_TOKENIZER,
    VOCAB,
    VllmServer,
    run_logged,
    start_server,
    venv_python,
)

MODEL_DIRS = {"idefics3": OUT / "tiny-idefics3", "qwen2-audio": OUT / "tiny-qwen2-audio"}
MAX_MODEL_LEN = 16384  # an image is up to 2,913 tokens here; a few per prompt
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32 for this model's layers

BUILD = TRAIN_TOKENIZER + textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    kind, out, vocab, max_len = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if kind == "idefics3":
        specials = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                    "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
        named = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                 "end_of_utterance_token": "<end_of_utterance>"}
        eos = "<end_of_utterance>"
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
        named = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
        eos = "<|im_end|>"
    tok = train_tokenizer(specials, "<|endoftext|>", vocab)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", extra_special_tokens=named)
    fast.model_max_length = max_len
    ids = {s: tok.token_to_id(s) for s in specials}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_len,
                tie_word_embeddings=True, pad_token_id=0, eos_token_id=ids[eos], bos_token_id=0)
    if kind == "idefics3":
        from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        template = (
            "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] in ['image', 'image_url'] %}<image>"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<end_of_utterance>\\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
        fast.chat_template = template
        config = Idefics3Config(
            vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                               image_size=364, patch_size=14),
            text_config=dict(model_type="llama", **text), scale_factor=2, image_token_id=ids["<image>"],
            pad_token_id=0, tie_word_embeddings=True, torch_dtype="float32")
        Idefics3ForConditionalGeneration(config).save_pretrained(out)
        Idefics3Processor(image_processor=Idefics3ImageProcessorPil(), tokenizer=fast, image_seq_len=169,
                          chat_template=template).save_pretrained(out)
    else:
        from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor
        from transformers import WhisperFeatureExtractor
        config = Qwen2AudioConfig(
            audio_config=dict(d_model=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=256,
                              num_mel_bins=128, max_source_positions=1500),
            text_config=dict(model_type="qwen2", **text), audio_token_index=ids["<|AUDIO|>"],
            tie_word_embeddings=True, torch_dtype="float32")
        Qwen2AudioForConditionalGeneration(config).save_pretrained(out)
        # transformers 5 nests the text model one level deeper than Qwen2-Audio's checkpoints (and vLLM) name it
        weights = out / "model.safetensors"
        renamed = {k.replace("language_model.model.model.", "language_model.model."): v
                   for k, v in load_file(weights).items()}
        save_file(renamed, weights, metadata={"format": "pt"})
        processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=fast)
        fast.chat_template = processor.chat_template = processor.default_chat_template
        processor.save_pretrained(out)
    fast.save_pretrained(out)
    print("built", kind, out)
    """
)


def build_media_model(kind: str = "idefics3") -> Path:
    """The random-weight `kind` (idefics3, qwen2-audio) and its processor, built once (same seed, same model)."""
    model_dir = MODEL_DIRS[kind]
    if (model_dir / "config.json").exists() and (model_dir / "processor_config.json").exists():
        return model_dir
    if kind == "qwen2-audio":
        install_audio()
    model_dir.mkdir(parents=True, exist_ok=True)
    script = model_dir.parent / "build_media_model.py"
    script.write_text(BUILD)
    run_logged([str(venv_python()), str(script), kind, str(model_dir), str(VOCAB), str(MAX_MODEL_LEN)])
    return model_dir


def install_audio() -> None:
    """vLLM's audio extra (librosa to read and resample clips, soundfile), once, into the vLLM venv."""
    if subprocess.run([str(venv_python()), "-c", "import librosa, soundfile"], capture_output=True).returncode:
        run_logged([str(venv_python()), "-m", "pip", "install", "-q", "librosa", "soundfile"])


def start_media_server(model_dir: Path, name: str, *, cpu: int, num_blocks: int, images: int = 4,
                       port: int | None = None, extra: tuple[str, ...] = (), resettable: bool = False) -> VllmServer:
    """One vLLM server of a model built here (its block size and context; up to `images` images a prompt), logging
    under a directory of its own; call `wait_healthy()` before use."""
    return start_server(Path(tempfile.mkdtemp(prefix=f"picker-{name}-")), name=name, block_size=BLOCK_SIZE,
                        num_blocks=num_blocks, model_dir=model_dir, cpu=cpu, port=port, max_model_len=MAX_MODEL_LEN,
                        resettable=resettable,
                        extra=["--limit-mm-per-prompt", json.dumps({"image": images}), *extra])
