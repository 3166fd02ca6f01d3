"""Device check: real model shapes trained for two GRPO iterations by ``train_math.py``, as one table.

    python -m bench.gpu_check [--models 0.5b 1.5b] [--device auto] [--batch 32] [--prompt_tokens 128]
                              [--new_tokens 256] [--micro_batches 4] [--dtype bfloat16] [--out FILE]

Each model (Qwen2.5-0.5B's or 1.5B's architecture, or a tiny Qwen2 for the CPU test) is initialised at
random and saved with a byte-level tokenizer covering its whole vocabulary; ``train_math.py`` then runs
GRPO (full fine-tuning) on a written MATH-style dataset whose prompts are ``--prompt_tokens`` long. A
random model practically never samples EOS, so every sample is ``--new_tokens`` long; it never earns a
reward either, so a small entropy bonus keeps every row in the update (GRPO skips zero-advantage rows).

The table reads the second iteration from the run's TensorBoard events (the first warms up kernels and
the allocator): generation tokens/s, the seconds of its phases, weight sync (free with HF, which
generates with the live weights), peak memory over the whole process (torch.cuda.max_memory_allocated
on a GPU, peak RSS on a CPU), and the update's MFU: 6 x parameters x tokens / update seconds / the
card's dense bf16 peak, tokens being the actions plus each group's prompt once (the update runs a shared
prompt once); attention FLOPs are not counted. Each model runs with the HF backend, then with vLLM when
it is importable.
"""

from __future__ import annotations

import argparse
import json
import resource
import string
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 2  # the table reads the last; the first warms up
GROUP_SIZE = 4  # GRPO samples per prompt
ENTROPY_COEF = 1e-3  # see the module docstring: without it a random model's update skips every row
EOS = "<|endoftext|>"
BACKENDS = ("hf", "vllm")
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
"""Dense bf16 peak FLOP/s by device name (the first entry the name contains): SXM cards unless named."""


@dataclass(frozen=True)
class Shape:
    """A Qwen2 architecture (tied embeddings, QKV bias)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SHAPES = {
    "0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936),
    "1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151_936),
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1_000),
}
"""Qwen2.5-0.5B and Qwen2.5-1.5B as published (config.json), and a tiny one for CPU tests."""


@dataclass
class Row:
    """One (model, backend) line of the table; ``skipped`` says why it has no measurements."""

    model: str
    params: int
    backend: str
    skipped: str | None = None
    tokens_per_second: float = 0.0
    seconds: dict[str, float] | None = None  # generate, reward, update, sync of the measured iteration
    peak_bytes: int = 0
    mfu: float | None = None


# -------------------------------------------------------------------------------------------------
# The model directory and the dataset
# -------------------------------------------------------------------------------------------------

def filler_token(index: int) -> str:
    """A vocabulary entry of four ASCII letters, distinct for each index (no newline or space in it, so
    sampled text never holds a stop string)."""
    letters = string.ascii_letters
    return "".join(letters[index // len(letters) ** k % len(letters)] for k in range(4))


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` entries: the 256 bytes, filler tokens, and EOS
    (also the pad) last. No merges: text is one token per byte, so every id decodes and prompt lengths
    are the texts' byte counts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({filler_token(i): i for i in range(len(vocab), vocab_size - 1)})
    vocab[EOS] = vocab_size - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)


def qwen2_config(shape: Shape):
    """The transformers config of ``shape``, with Qwen2.5's RoPE base, norm epsilon and context length;
    EOS (and BOS) is the last id, as ``byte_level_tokenizer`` has it."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=32_768, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                       bos_token_id=shape.vocab - 1, eos_token_id=shape.vocab - 1)


def write_model(shape: Shape, directory: Path, dtype: str, device: str) -> int:
    """Saves a randomly initialised Qwen2 model of ``shape`` in ``dtype`` with its tokenizer to
    ``directory``; returns its parameter count. Initialised on ``device``: a CPU draws normal samples on
    one thread, ~70 s for 1.5B parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    byte_level_tokenizer(shape.vocab).save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the training run is another process
    return params


def write_problems(path: Path, count: int, prompt_tokens: int) -> None:
    """Writes ``count`` distinct problems whose prompts (train_math's default template) are
    ``prompt_tokens`` bytes, hence tokens, long."""
    from envs.prompts import format_prompt

    length = prompt_tokens - len(format_prompt("").encode())
    if length < 8:
        raise ValueError(f"--prompt_tokens={prompt_tokens} leaves {length} tokens for the problem after the "
                         "template; pass at least 8 more")
    lines = []
    for i in range(count):
        problem = (f"{i:06d} " + "what is one plus one " * length)[:length]
        lines.append(json.dumps({"unique_id": str(i), "problem": problem, "answer": "2"}))
    path.write_text("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------------------------
# Running train_math.py
# -------------------------------------------------------------------------------------------------

CHILD = "import sys; from bench.gpu_check import train_child; train_child(sys.argv[1], sys.argv[2:])"


def train_child(result_path: str, flags: list[str]) -> None:
    """``python train_math.py FLAGS`` in this process, then its peak memory and device written to
    ``result_path`` (JSON), even when the run fails (train_math ends by SystemExit)."""
    import torch

    import train_math

    sys.argv = ["train_math.py", *flags]
    try:
        train_math.run()
    finally:
        cuda = torch.cuda.is_initialized()
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(result_path).write_text(json.dumps({"peak_bytes": peak,
                                                 "device": torch.cuda.get_device_name() if cuda else "cpu"}))


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {iteration: value}} of every scalar in the TensorBoard event files under ``run_dir``
    (records: 8-byte length, 4-byte CRC, the event, 4-byte CRC)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(run_dir.rglob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def train_flags(model_dir: Path, dataset: Path, logdir: Path, backend: str, args: argparse.Namespace) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--dataset_path", str(dataset), "--logdir", str(logdir),
            "--experiment_name", "gpu_check", "--generation_backend", backend, "--device", args.device,
            "--dtype", args.dtype, "--n_rollout_threads", str(args.batch), "--group_size", str(GROUP_SIZE),
            "--gradient_cp_steps", str(args.micro_batches),
            "--num_env_steps", str(ITERATIONS * args.batch), "--max_new_tokens", str(args.new_tokens),
            "--temperature", "1.0", "--entropy_coef", str(ENTROPY_COEF), "--noasync_rollouts",
            "--eval_interval", "0", "--save_interval", "0"]


def run_train_math(flags: list[str], logdir: Path) -> tuple[dict[str, float], dict]:
    """(the last iteration's scalars, the child's peak memory and device) of one train_math run."""
    result = logdir / "child.json"
    completed = subprocess.run([sys.executable, "-c", CHILD, str(result), *flags], cwd=ROOT, capture_output=True,
                               text=True)
    if completed.returncode != 0:
        sys.stderr.write(completed.stderr[-4000:])
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"train_math.py exited with {completed.returncode} ({last}); its stderr's end is above")
    scalars = {tag: steps[ITERATIONS - 1] for tag, steps in read_scalars(logdir).items() if ITERATIONS - 1 in steps}
    if scalars.get("train/optimizer_steps") != 1.0:
        raise RuntimeError(f"the measured iteration took {scalars.get('train/optimizer_steps')} optimizer steps, "
                           "not 1: its update time is not one update's")
    return scalars, json.loads(result.read_text())


def peak_flops(device: str) -> float | None:
    """The card's dense bf16 peak FLOP/s (``PEAK_BF16_FLOPS``); None for a CPU or a card not listed."""
    return next((flops for name, flops in PEAK_BF16_FLOPS if name in device), None)


def measure(name: str, params: int, backend: str, model_dir: Path, dataset: Path,
            args: argparse.Namespace) -> tuple[Row, str]:
    """One row from one train_math run, and the device it ran on."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_run_") as logdir:
        scalars, child = run_train_math(train_flags(model_dir, dataset, Path(logdir), backend, args), Path(logdir))
    print(f"{name} {backend}: train_math.py took {time.perf_counter() - started:.0f} s (start-up, {ITERATIONS} "
          "iterations, the final checkpoint)", file=sys.stderr, flush=True)
    seconds = {phase: scalars[f"time/{phase}"] for phase in ("generate", "reward", "update", "sync")}
    tokens = args.batch * scalars["train/action_tokens"] + args.batch // GROUP_SIZE * args.prompt_tokens
    peak = peak_flops(child["device"]) if args.dtype == "bfloat16" else None
    mfu = 6 * params * tokens / seconds["update"] / peak if peak else None
    return Row(name, params, backend, tokens_per_second=scalars["perf/tokens_per_second"], seconds=seconds,
               peak_bytes=child["peak_bytes"], mfu=mfu), child["device"]


# -------------------------------------------------------------------------------------------------
# The table
# -------------------------------------------------------------------------------------------------

HEADER = ("| model | params | backend | gen tokens/s | iteration s | generate s | reward s | update s | sync s "
          "| peak memory GiB | update MFU |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(row: Row) -> str:
    cells = [row.model, f"{row.params / 1e6:,.1f}M", row.backend]
    if row.skipped is not None:
        return "| " + " | ".join(cells + [row.skipped] + ["-"] * 7) + " |"
    seconds = row.seconds
    cells += [f"{row.tokens_per_second:,.0f}", f"{sum(seconds.values()):.2f}",
              *(f"{seconds[phase]:.2f}" for phase in ("generate", "reward", "update", "sync")),
              f"{row.peak_bytes / 2**30:.2f}", "-" if row.mfu is None else f"{row.mfu:.1%}"]
    return "| " + " | ".join(cells) + " |"


def caption(device: str, args: argparse.Namespace) -> str:
    peak = peak_flops(device)
    return (f"{device}{f' (dense bf16 peak {peak / 1e12:.0f} TFLOP/s)' if peak else ''}: train_math.py GRPO, "
            f"full fine-tuning in {args.dtype}, random-init weights; {args.batch} samples ({args.batch // GROUP_SIZE} "
            f"prompts x {GROUP_SIZE}) of {args.prompt_tokens} prompt + {args.new_tokens} new tokens, "
            f"{args.micro_batches} micro-batches per update; the second of {ITERATIONS} iterations.")


def resolved_device(device: str) -> str:
    """``auto``: cuda when available, else cpu."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def vllm_missing() -> str | None:
    """Why the vLLM rows are skipped, or None when vLLM imports."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm not installed"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1.5b"])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--batch", type=int, default=32, help="samples per iteration (a multiple of 4)")
    parser.add_argument("--prompt_tokens", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--micro_batches", type=int, default=4, help="micro-batches per update (train_math's "
                        "--gradient_cp_steps): 4 keeps 1.5B's vocabulary-wide logits of 32 x 256 tokens within an "
                        "H100 (in one micro-batch its second update ran out of 80 GB)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.batch < GROUP_SIZE or args.batch % GROUP_SIZE:
        parser.error(f"--batch={args.batch} must be a positive multiple of the group size {GROUP_SIZE}")
    started, skip_vllm, device = time.perf_counter(), vllm_missing(), "cpu"
    args.device = resolved_device(args.device)
    lines = [HEADER]
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        dataset = Path(work) / "problems.jsonl"
        write_problems(dataset, args.batch, args.prompt_tokens)
        for name in args.models:
            model_dir, built = Path(work) / name, time.perf_counter()
            params = write_model(SHAPES[name], model_dir, args.dtype, args.device)
            print(f"{name}: random-init model written in {time.perf_counter() - built:.0f} s", file=sys.stderr,
                  flush=True)
            for backend in BACKENDS:
                if backend == "vllm" and skip_vllm:
                    row = Row(name, params, backend, skipped=skip_vllm)
                else:
                    row, device = measure(name, params, backend, model_dir, dataset, args)
                lines.append(table_row(row))
                print(lines[-1], flush=True)
    text = caption(device, args) + "\n\n" + "\n".join(lines) + "\n"
    print(f"\n{caption(device, args)} {time.perf_counter() - started:.0f} s in all.")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
