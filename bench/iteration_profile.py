"""Where one iteration of the default run spends its time: generation, rewards, the update (log-probs,
backward, optimizer), weight sync and logging.

    python -m bench.iteration_profile [--iterations 30] [--top 12] [--real_model [--mixed]]
                                     [-- extra train_math flags]

Builds the run as ``python train_math.py`` does (``train.builders.build_runner`` from the default
flags: the built-in tiny policy, GRPO on Arith-v0, 128 envs), synchronously so the phases do not
overlap, runs a few warm-up iterations, then ``--iterations`` more under cProfile. Prints the runner's
own seconds per phase (what TensorBoard's ``time/*`` show) and the functions that took the most time.

``--real_model``: the real-model bench's full fine-tuning run instead (``bench.real_model_learning``:
SmolLM2-135M-Instruct, GRPO 8 x 8 at temperature 0.3, 128 new tokens). ``--mixed`` pays each sample a fixed
pseudo-random bonus drawn from its text (``bench.vs_trl.TextHashOutcome``), so that every group trains: the
update's shape once a run learns, from its first iteration.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

PHASES = ("time/generate", "time/reward", "time/update", "time/sync")


class PhaseWriter:
    """Collects the scalars the runner logs (a stand-in for TensorBoard's writer)."""

    def __init__(self) -> None:
        self.scalars: dict[str, list[float]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.setdefault(tag, []).append(float(value))

    def add_histogram(self, *args, **kwargs) -> None:
        pass  # histograms are not timed phases

    def add_text(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass


def real_model_flags() -> list[str]:
    """The real-model bench's full fine-tuning flags (its budget and evaluation replaced by this bench's)."""
    from bench.real_model_learning import parse_args, run_flags

    return run_flags("full", parse_args(["--modes", "full"]))


def build(run_dir: Path, base: list[str], extra: list[str], mixed: bool):
    """The runner of ``base`` flags, then this bench's (synchronous, no evaluation or checkpoint, an open-ended
    budget), then ``extra`` (absl keeps a repeated flag's last value)."""
    from train import builders
    from train.flags import FLAGS, config_from_flags

    FLAGS(["iteration_profile", *base, "--noasync_rollouts", "--eval_interval", "0", "--save_interval", "0",
           "--num_env_steps", str(10**9), *extra])
    config = config_from_flags(FLAGS)
    torch.set_num_threads(config.model.torch_threads)
    torch.manual_seed(config.budget.seed)
    writer = PhaseWriter()
    runner = builders.build_runner(config, run_dir, writer)
    if mixed:
        from bench.vs_trl import reward_every_group

        reward_every_group(runner)
    return runner, writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="Functions to list by own time (0: the phases alone).")
    parser.add_argument("--real_model", action="store_true", help="Profile the real-model bench's run (module "
                        "docstring); flags after -- still override its own.")
    parser.add_argument("--mixed", action="store_true", help="Every group trains (module docstring).")
    parser.add_argument("extra", nargs="*", help="train_math.py flags after --")
    args = parser.parse_args()
    base = real_model_flags() if args.real_model else []
    with tempfile.TemporaryDirectory() as run_dir:
        runner, writer = build(Path(run_dir), base, args.extra, args.mixed)
        postfix: dict[str, str] = {}
        for iteration in range(args.warmup):
            runner.train_iteration(iteration, postfix)
        writer.scalars.clear()
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        for iteration in range(args.warmup, args.warmup + args.iterations):
            runner.train_iteration(iteration, postfix)
        profile.disable()
        seconds = (time.perf_counter() - started) / args.iterations
    phases = {tag: statistics.mean(writer.scalars[tag]) for tag in PHASES}
    print(f"{args.iterations} iterations after {args.warmup} warm-up, {seconds:.3f} s each "
          f"({torch.get_num_threads()} torch thread(s))\n\n| phase | s/iteration | share |\n|---|---:|---:|")
    for tag, value in phases.items():
        print(f"| {tag.removeprefix('time/')} | {value:.3f} | {value / seconds:.0%} |")
    rest = seconds - sum(phases.values())
    print(f"| the rest (logging, bookkeeping) | {rest:.3f} | {rest / seconds:.0%} |")
    if args.top:  # 0: the phases alone
        text = io.StringIO()
        pstats.Stats(profile, stream=text).strip_dirs().sort_stats("tottime").print_stats(args.top)
        lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        print(f"\ntop {args.top} functions by own time:\n" + "\n".join(lines[start:start + args.top + 1]))


if __name__ == "__main__":
    main()
