"""Iterations/s and completions/s of the default GRPO run in one process and under torchrun.

    python bench/data_parallel.py [--iterations 20 60] [--ranks 2] [--n_rollout_threads 128]

Each setting trains ``python train_math.py`` (the built-in tiny policy on Arith-v0, GRPO, one solution
per episode, no evaluation, no checkpoints but the last) twice, for the two iteration counts; the
difference of the two wall times over the difference of the counts is the time of one iteration
without the start-up (imports, model loading, process group). Settings: one process synchronous, one
process with asynchronous rollouts (the CPU default: generation on the second core), and ``--ranks``
ranks under torchrun, synchronous, one torch thread each, with the policy sharded (FSDP2, the default
for full fine-tuning) and replicated (DDP). completions/s = n_rollout_threads /
seconds per iteration.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall_seconds(launcher: list[str], flags: list[str], iterations: int, envs: int) -> float:
    with tempfile.TemporaryDirectory() as logdir:
        command = [*launcher, str(ROOT / "train_math.py"), "--logdir", logdir, "--eval_interval", "0",
                   "--save_interval", "0", "--n_rollout_threads", str(envs), "--num_env_steps",
                   str(envs * iterations), *flags]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, nargs=2, default=(20, 60))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--n_rollout_threads", type=int, default=128)
    args = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks)]
    settings = {"1 process, synchronous": ([sys.executable], ["--noasync_rollouts"]),
                "1 process, asynchronous rollouts (default)": ([sys.executable], ["--async_rollouts"]),
                **{f"{args.ranks} ranks (torchrun, gloo, {mode.upper()}), synchronous":
                   (torchrun, ["--noasync_rollouts", "--data_parallel", mode]) for mode in ("fsdp", "ddp")}}
    few, many = args.iterations
    print(f"GRPO on Arith-v0, {args.n_rollout_threads} envs per iteration in all, {os.cpu_count()} cores\n")
    print("| setting | s/iteration | iterations/s | completions/s |\n|---|---:|---:|---:|")
    for name, (launcher, flags) in settings.items():
        short = wall_seconds(launcher, flags, few, args.n_rollout_threads)
        long = wall_seconds(launcher, flags, many, args.n_rollout_threads)
        per_iteration = (long - short) / (many - few)
        print(f"| {name} | {per_iteration:.3f} | {1 / per_iteration:.2f} | "
              f"{args.n_rollout_threads / per_iteration:.0f} |", flush=True)


if __name__ == "__main__":
    main()
