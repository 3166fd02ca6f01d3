"""A real pretrained instruct model trained by ``train_math.py``'s own path, and what it gained.

    python -m bench.real_model_learning [--task arith|math] [--model DIR_OR_HUB_ID] [--modes lora full]
                                        [--iterations N] [--eval_interval N] [--eval_limit 500] [--seed 0]
                                        [--out runs/real_model_learning]

Each mode is one ``python train_math.py`` run (GRPO under the model's own chat template, the answer
format asked for as ``--answer_instruction`` does by default), evaluated greedily on ``--eval_limit``
held-out problems at the start, every ``--eval_interval`` iterations and at the end. Tasks:

- ``arith`` (the default, 2 CPU cores): SmolLM2-135M-Instruct (``python -m models.smollm2`` converts it
  into the cache) on an Arith difficulty where it has signal: sums of two or three one-digit numbers.
  Greedy, it answers about a fifth of them right. Sampled at temperature 0.7 its answers drift (mean@4
  0.10, pass@4 0.30 on 64 problems); at 0.3 they are right as often as greedy ones and still differ
  (mean@4 0.22, pass@4 0.56), so the runs sample at 0.3.
- ``math`` (one GPU, the vllm and hf extras): Qwen2.5-0.5B-Instruct by hub id on MATH's 7,500 training
  problems, MATH-500 held out, in the settings of peers' GRPO recipes (groups of 8 at temperature 1.0,
  1,024 new tokens, lr 1e-6), pass@1 also estimated from 4 samples at temperature 0.6 and top-p 0.95.

What a gain is made of: ``eval/readable`` is the share of answers the grader can read (boxed, or after
"the answer is"), ``eval/accuracy_readable`` the accuracy among those. Accuracy is their product, so a
gain splits into format (more readable answers at the start's accuracy among them) and arithmetic (the
rest: more of the readable answers right). The standard error of an accuracy ``p`` on ``n`` problems is
``sqrt(p (1 - p) / n)``; a gain's is that of the difference of two independent estimates (the same
problems are evaluated twice, so it overstates the noise a little).

Outputs in ``--out``: ``runs/<mode>/`` (train_math's logdir: TensorBoard, ``train.log``, ``history.json``),
``curve.csv`` (one line per mode and evaluation), ``curve.png`` (with matplotlib), and on stdout one line
per mode ending ``held-out accuracy A -> B (+G points, Z standard errors) in M minutes``. Minutes are
training time (train_math's ``seconds``: evaluations and start-up excluded). Re-running the same command
reuses finished runs and continues an interrupted one.
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bench.learning_table import train_math_history

ARITH = {"digits": 1, "min_ops": 1, "max_ops": 2, "operators": "+", "num_train": 500, "num_test": 500}
"""The arith task: sums of two or three one-digit numbers (1,100 distinct problems), 500 held out. The
held-out set is drawn first and takes all 100 one-operation sums, so training sees two-operation sums
only and a fifth of the held-out problems are of a form it never trains on."""

MICRO_BATCH_TOKENS = 1536
"""The arith task's update micro-batches, in forwarded positions (``--micro_batch_tokens``): a group of 8 answers
of at most 128 tokens and its prompt fit one. Without activation checkpointing SmolLM2-135M keeps about 1.5 MB
of activations a position for the backward (30 layers, float32), so a micro-batch holds at most 2.3 GB beside
the 2.2 GB of weights, gradients and AdamW states (``bench.memory_phases``)."""


@dataclass(frozen=True)
class Task:
    """One preset: the model by default, train_math's flags, each mode's own, and the run's length."""

    model: str | None  # None: SmolLM2-135M-Instruct in the cache
    flags: tuple[str, ...]
    modes: dict[str, tuple[str, ...]]
    samples_per_iteration: int
    iterations: int
    eval_interval: int


TASKS = {
    # GRPO in groups of 8, 8 prompts an iteration; both cores to one process (the asynchronous sampler
    # would take one of them)
    "arith": Task(None, ("--env_kwargs", json.dumps({"arith": ARITH}), "--reward", "outcome", "--temperature", "0.3",
                         "--group_size", "8", "--n_rollout_threads", "64", "--max_new_tokens", "128", "--lr_schedule",
                         "constant", "--warmup_iterations", "2", "--torch_threads", "2", "--noasync_rollouts",
                         "--micro_batch_tokens", str(MICRO_BATCH_TOKENS)),
                  {"lora": ("--lora_rank", "16", "--lr", "1e-4"), "full": ("--lr", "2e-5")}, 64, 24, 8),
    "math": Task("Qwen/Qwen2.5-0.5B-Instruct",
                 ("--dataset_path", "hf://DigitalLearningGmbH/MATH-lighteval:train", "--eval_dataset_path",
                  "envs/data/math500.jsonl", "--device", "cuda", "--dtype", "bfloat16", "--generation_backend", "vllm",
                  "--gradient_checkpointing", "--micro_batch_tokens", "16384", "--temperature", "1.0",
                  "--group_size", "8", "--n_rollout_threads", "512", "--max_new_tokens", "1024",
                  "--eval_samples", "4", "--eval_temperature", "0.6", "--eval_top_p", "0.95"),
                 {"lora": ("--lora_rank", "64", "--lr", "1e-5"), "full": ("--lr", "1e-6")}, 512, 200, 20),
}
"""Each task's preset; a mode trains a LoRA or every weight (a pretrained model takes a small lr)."""
COMMON_FLAGS = ("--prompt_template", "chat", "--keep_checkpoints", "1", "--save_interval", "10")
CSV_KEYS = ("mode", "iteration", "env_steps", "minutes", "accuracy", "standard_error", "readable",
            "accuracy_readable", "mean_length")


def default_model() -> str:
    from models.smollm2 import cache_dir

    return str(cache_dir())


def weights_digest(directory: Path) -> str:
    """SHA-256 over the safetensors files of ``directory``, in name order."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache
def model_identity(model: str) -> str:
    """A model directory's weights digest (the same weights wherever the directory lies), else the name given."""
    return f"sha256:{weights_digest(Path(model))}" if Path(model).is_dir() else model


def run_flags(mode: str, args: argparse.Namespace) -> list[str]:
    """train_math's flags for one mode (its logdir and --resume aside)."""
    task = TASKS[args.task]
    return ["--model_name_or_path", args.model, *COMMON_FLAGS, *task.flags, *task.modes[mode],
            "--num_env_steps", str(args.iterations * task.samples_per_iteration),
            "--eval_interval", str(args.eval_interval), "--eval_limit", str(args.eval_limit),
            "--eval_batch_size", str(min(args.eval_limit, 250)), "--seed", str(args.seed), "--experiment_name", mode]


def standard_error(accuracy: float, n: int) -> float:
    """Binomial standard error of an accuracy measured on ``n`` problems."""
    return math.sqrt(accuracy * (1 - accuracy) / n)


def gain_split(before: dict[str, float], after: dict[str, float]) -> tuple[float, float] | None:
    """(format, arithmetic) parts of the accuracy gain from ``before`` to ``after``: accuracy = readable x
    accuracy among readable, so format = d(readable) x before's accuracy among readable and arithmetic =
    after's readable x d(accuracy among readable); they add up to the gain. None when not logged."""
    if "eval/readable" not in before:
        return None
    format_part = (after["eval/readable"] - before["eval/readable"]) * before["eval/accuracy_readable"]
    arithmetic = after["eval/readable"] * (after["eval/accuracy_readable"] - before["eval/accuracy_readable"])
    return format_part, arithmetic


def gain_z(before: float, after: float, n: int) -> float:
    """The gain from accuracy ``before`` to ``after`` (each on ``n`` problems) in standard errors of the
    difference of two independent estimates."""
    gain_se = math.hypot(standard_error(before, n), standard_error(after, n))
    return (after - before) / gain_se if gain_se else math.inf


def summary(mode: str, history: list[dict[str, float]], n: int) -> str:
    """One line: the gain from the first evaluation to the last, in points and standard errors, its split."""
    before, after = history[0], history[-1]
    a, b = before["eval/accuracy"], after["eval/accuracy"]
    z = gain_z(a, b, n)
    split = gain_split(before, after)
    parts = "" if split is None else f"format {100 * split[0]:+.1f}, arithmetic {100 * split[1]:+.1f} points; "
    return (f"{mode}: {parts}held-out accuracy {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} points, {z:.1f} standard "
            f"errors) in {after['seconds'] / 60:.0f} minutes")


def curve_rows(histories: dict[str, list[dict[str, float]]], n: int) -> list[dict[str, object]]:
    return [{"mode": mode, "iteration": h["iteration"], "env_steps": h["env_steps"],
             "minutes": round(h["seconds"] / 60, 2), "accuracy": h["eval/accuracy"],
             "standard_error": round(standard_error(h["eval/accuracy"], n), 4),
             "readable": h.get("eval/readable", ""), "accuracy_readable": h.get("eval/accuracy_readable", ""),
             "mean_length": round(h["eval/mean_length"], 1)}
            for mode, history in histories.items() for h in history]


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (said on stdout) where matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return None
    return plt


def plot(rows: list[dict[str, object]], path: Path) -> Path | None:
    """Held-out accuracy against training minutes, one line per mode with a one-standard-error band."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(row["mode"] for row in rows):
        mine = [row for row in rows if row["mode"] == mode]
        minutes = [row["minutes"] for row in mine]
        accuracy = [row["accuracy"] for row in mine]
        se = [row["standard_error"] for row in mine]
        axes.plot(minutes, accuracy, marker="o", label=mode)
        axes.fill_between(minutes, [a - s for a, s in zip(accuracy, se)], [a + s for a, s in zip(accuracy, se)],
                          alpha=0.2)
    axes.set(xlabel="training minutes", ylabel="held-out greedy accuracy", title="GRPO on a real instruct model")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=tuple(TASKS), default="arith", help="Preset (module docstring).")
    parser.add_argument("--model", default=None, help="Model directory or hub id (default: the task's; arith: "
                        "SmolLM2-135M-Instruct in the cache, from python -m models.smollm2).")
    parser.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora", "full"])
    parser.add_argument("--iterations", type=int, default=None, help="GRPO iterations per mode (arith: 24 of 64 "
                        "samples; math: 200 of 512).")
    parser.add_argument("--eval_interval", type=int, default=None, help="Evaluate every this many iterations "
                        "(arith: 8; math: 20).")
    parser.add_argument("--eval_limit", type=int, default=500, help="Held-out problems per evaluation.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/real_model_learning"))
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    args.model = args.model or task.model or default_model()
    args.iterations = args.iterations or task.iterations
    args.eval_interval = args.eval_interval or task.eval_interval
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    histories = {mode: train_math_history(run_flags(mode, args), args.out / "runs" / mode) for mode in args.modes}
    rows = curve_rows(histories, args.eval_limit)
    with open(args.out / "curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_KEYS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "curve.png")
    for mode, history in histories.items():
        print(summary(mode, history, args.eval_limit), flush=True)


if __name__ == "__main__":
    main()
