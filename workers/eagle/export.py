"""Export an EAGLE-3 head to the published layout, for vLLM, SGLang and SpecForge.

    python -m workers.eagle.export --out DIR                       # the bundled model's head
    python -m workers.eagle.export --head FILE --model MODEL --out DIR

Writes `DIR/config.json` and `DIR/model.safetensors` (workers/eagle/layout.py): the head's
weights under the layout's names, the target's LM head rows for its draft vocabulary as its own
`lm_head` (ours borrows them), `d2t`/`t2d`, and both spellings of the target layers it fuses.
The target is read in fp32 with its weights dequantized, so those rows are the target's floats.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import load_head, save_folder
from workers.model.loader import build_model, load_checkpoint, parse_dtype


def export(head_path: Path, model: str | None, out: Path, dtype: torch.dtype) -> dict[str, object]:
    """Write the folder; returns its config."""
    checkpoint = load_checkpoint(model, dtype=torch.float32, quantization="none")
    target = build_model(checkpoint, dtype=torch.float32)
    head = load_head(head_path, checkpoint.config)
    head.attach(target)
    head = head.to(dtype)
    if isinstance(head.lm_head, torch.Tensor):  # the target's rows, borrowed after the cast
        head.lm_head = head.lm_head.to(dtype)
    save_folder(head, out, checkpoint.config)
    config: dict[str, object] = json.loads((out / "config.json").read_text())
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, default=BUNDLED_HEAD, help="our head file or folder")
    parser.add_argument("--model", default=None, help="its target (default: the bundled model)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    args = parser.parse_args(argv)
    config = export(args.head, args.model, args.out, parse_dtype(args.dtype))
    print(json.dumps({"out": str(args.out), "config": config}, indent=2))


if __name__ == "__main__":
    main()
