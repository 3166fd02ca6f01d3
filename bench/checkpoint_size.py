"""Bytes on disk of one training checkpoint (``checkpoints/iter_N``, by part) and of the exported policy
(``best/``) at a real model shape, as ``train_math.py`` writes them.

    python bench/checkpoint_size.py [--models 0.5b] [--cases full,lora] [--dtype bfloat16]

The model is a random-init Qwen2.5 config (``bench/memory.py``'s, with its byte-level tokenizer); the
policy is built as a run builds it (fp32 master weights for full fine-tuning, the frozen LoRA base in
``--dtype``, rank-16 LoRA on all linear layers), AdamW takes one step on zero gradients so that its
moments exist, and ``train.checkpoint_files.save`` and ``Checkpointer.save_best``'s export write the files.
Sizes are bytes of the files (GB = 10^9 bytes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import LORA_RANK, write_model  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def measure(model_dir: Path, case: str, dtype: str, scratch: Path) -> dict[str, int]:
    """Bytes of each part of a checkpoint and of the best/ export for one case."""
    from models.loading import DTYPES
    from models.policy import LanguagePolicy, LoraSettings
    from train import checkpoint_files

    lora = LoraSettings(rank=LORA_RANK) if case == "lora" else None
    policy = LanguagePolicy(model_dir, device="cpu", dtype=dtype, lora=lora)
    trained_parameters = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained_parameters, lr=1e-6)
    for param in trained_parameters:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    path = checkpoint_files.save(scratch / "checkpoints", 1, policy=policy, optimizer=optimizer, optimizers={},
                           rng=checkpoint_files.rng_state(), state={}, flags={})
    best = policy.save(scratch / "best", dtype=DTYPES[dtype])
    sizes = {part.name: directory_bytes(part) if part.is_dir() else part.stat().st_size for part in path.iterdir()}
    return {**sizes, "checkpoint": directory_bytes(path), "best": directory_bytes(best)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="0.5b")
    parser.add_argument("--cases", default="full,lora")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            model_dir = write_model(name, Path(scratch) / "model")
            for case in args.cases.split(","):
                out = Path(scratch) / case
                sizes = measure(model_dir, case, args.dtype, out)
                parts = ", ".join(f"{part} {size / 1e9:.3f}" for part, size in sorted(sizes.items())
                                  if part not in ("checkpoint", "best") and size >= 1e6)
                print(f"Qwen2.5-{name} {case} ({args.dtype}): checkpoint {sizes['checkpoint'] / 1e9:.2f} GB "
                      f"({parts}); best/ {sizes['best'] / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
