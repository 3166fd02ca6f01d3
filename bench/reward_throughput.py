"""PRM scoring throughput: steps/s of the tiny Math-Shepherd PRM scoring N=64 trajectories in one
batched call (what MathVectorEnv does every env step) vs one call per trajectory.

    python bench/reward_throughput.py [--num_envs 64] [--repeats 5] [--prm_dir DIR]

Without --prm_dir it uses the built-in tiny PRM (train.tiny, built and cached on first use).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from envs.datasets import Arith
from envs.prompts import split_steps
from reward_models.base import StepContext
from reward_models.prm import ProcessRewardModel


def contexts(num_envs: int, seed: int) -> list[StepContext]:
    """N trajectories at a random step of their reference solution."""
    problems = Arith().problems(num_envs, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for problem in problems:
        steps = split_steps(problem.solution)
        k = int(torch.randint(len(steps), (1,), generator=generator))
        out.append(StepContext(problem, tuple(steps[:k]), steps[k], done=k == len(steps) - 1))
    return out


def steps_per_second(prm: ProcessRewardModel, batch: list[StepContext], batched: bool, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        if batched:
            prm.score(batch)
        else:
            for context in batch:
                prm.score([context])
        rates.append(len(batch) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_envs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prm_dir", default=None, help="a Math-Shepherd PRM directory (default: the tiny PRM)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="sequences per PRM forward within the one call (default: the PRM's own)")
    args = parser.parse_args()
    if args.prm_dir is None:
        from train.tiny import build_tiny_models

        args.prm_dir = build_tiny_models().prm
    kwargs = {} if args.batch_size is None else {"batch_size": args.batch_size}
    prm = ProcessRewardModel(args.prm_dir, device=args.device, **kwargs)
    batch = contexts(args.num_envs, seed=0)
    prm.score(batch)  # warm-up
    batched = steps_per_second(prm, batch, batched=True, repeats=args.repeats)
    single = steps_per_second(prm, batch, batched=False, repeats=args.repeats)
    print(f"PRM {args.prm_dir} on {args.device}, N={args.num_envs}: batched {batched:.0f} steps/s, "
          f"one at a time {single:.0f} steps/s")
    print(f"summary: reward_throughput batched/single = {batched / single:.1f}x ({batched:.0f} vs {single:.0f} steps/s)")


if __name__ == "__main__":
    main()
