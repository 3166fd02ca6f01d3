"""PRM scoring throughput: steps/s of the tiny Math-Shepherd PRM scoring N=64 trajectories in one
batched call (what MathVectorEnv does every env step) vs one call per trajectory.

    python bench/reward_throughput.py [--num_envs 64] [--repeats 5] [--prm_dir DIR]

With ``--episodes``: whole episodes instead, as the env runs them. N trajectories step through the
reference solutions of successive problems (a new problem as soon as one ends), one ``score`` call
per env step, for ``--env_steps`` steps; steps/s with full recomputation vs the PRM's KV cache
(``--kv_cache_mb``), and the largest difference between their rewards.

    python bench/reward_throughput.py --episodes [--env_steps 32] [--kv_cache_mb 1024]

Without --prm_dir it uses the tiny PRM the package ships (models/tiny/shipped).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from envs.datasets import Arith
from envs.prompts import split_steps
from envs.rewards import StepContext
from reward_models.prm import DEFAULT_KV_CACHE_MB, ProcessRewardModel


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


def episode_calls(num_envs: int, env_steps: int, seed: int) -> list[list[StepContext]]:
    """The ``score`` calls of ``env_steps`` env steps: env i works through its own queue of Arith
    problems, one reference step per env step, starting the next problem when one ends."""
    solutions = iter(Arith().problems(num_envs * env_steps, seed=seed))  # enough for 1-step episodes
    current = [next(solutions) for _ in range(num_envs)]
    done_steps = [0] * num_envs
    calls = []
    for _ in range(env_steps):
        batch = []
        for i, problem in enumerate(current):
            steps = split_steps(problem.solution)
            k = done_steps[i]
            batch.append(StepContext(problem, tuple(steps[:k]), steps[k], done=k == len(steps) - 1))
            done_steps[i] = 0 if k == len(steps) - 1 else k + 1
            current[i] = next(solutions) if done_steps[i] == 0 else problem
        calls.append(batch)
    return calls


def run_episodes(prm: ProcessRewardModel, calls: list[list[StepContext]]) -> tuple[float, np.ndarray]:
    """(steps/s of one run of all ``calls`` from a cold cache, the rewards [C * N] it paid)."""
    if prm.past_cache is not None:
        prm.past_cache.clear()  # every run starts cold, as a fresh env would
    start = time.perf_counter()
    rewards = [prm.score(batch).rewards for batch in calls]
    return sum(map(len, calls)) / (time.perf_counter() - start), np.concatenate(rewards)


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


def compare_episodes(args: argparse.Namespace, kwargs: dict) -> None:
    """Prints steps/s of whole episodes scored by full recomputation and by the KV cache."""
    calls = episode_calls(args.num_envs, args.env_steps, seed=0)
    prms = {"full": ProcessRewardModel(args.prm_dir, device=args.device, kv_cache_mb=0, **kwargs),
            "cached": ProcessRewardModel(args.prm_dir, device=args.device, kv_cache_mb=args.kv_cache_mb, **kwargs)}
    for prm in prms.values():
        run_episodes(prm, calls[:2])  # warm-up
    runs: dict[str, list[tuple[float, np.ndarray]]] = {name: [] for name in prms}
    for _ in range(args.repeats):  # alternating, so that load from other jobs slows both alike
        for name, prm in prms.items():
            runs[name].append(run_episodes(prm, calls))
    full, cached = (statistics.median(rate for rate, _ in runs[name]) for name in prms)
    difference = float(np.abs(runs["full"][-1][1] - runs["cached"][-1][1]).max())
    print(f"PRM {args.prm_dir} on {args.device}, N={args.num_envs}, {args.env_steps} env steps "
          f"({sum(c.done for batch in calls for c in batch)} episodes ended): full {full:.0f} steps/s, "
          f"KV cache {cached:.0f} steps/s, max reward difference {difference:.1e}")
    print(f"summary: reward_throughput episodes cached/full = {cached / full:.2f}x "
          f"({cached:.0f} vs {full:.0f} steps/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_envs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prm_dir", default=None, help="a Math-Shepherd PRM directory (default: the tiny PRM)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="sequences per PRM forward within the one call (default: the PRM's own)")
    parser.add_argument("--episodes", action="store_true",
                        help="simulate whole episodes and compare full recomputation with the KV cache")
    parser.add_argument("--env_steps", type=int, default=32, help="env steps per episode run (--episodes)")
    parser.add_argument("--kv_cache_mb", type=float, default=DEFAULT_KV_CACHE_MB,
                        help="the cached PRM's cap in MiB (--episodes)")
    args = parser.parse_args()
    if args.prm_dir is None:
        from models.tiny import shipped_models

        args.prm_dir = shipped_models(team=False).prm
    kwargs = {} if args.batch_size is None else {"batch_size": args.batch_size}
    if args.episodes:
        compare_episodes(args, kwargs)
        return
    prm = ProcessRewardModel(args.prm_dir, device=args.device, kv_cache_mb=0, **kwargs)  # repeats one batch: no cache
    batch = contexts(args.num_envs, seed=0)
    prm.score(batch)  # warm-up
    batched = steps_per_second(prm, batch, batched=True, repeats=args.repeats)
    single = steps_per_second(prm, batch, batched=False, repeats=args.repeats)
    print(f"PRM {args.prm_dir} on {args.device}, N={args.num_envs}: batched {batched:.0f} steps/s, "
          f"one at a time {single:.0f} steps/s")
    print(f"summary: reward_throughput batched/single = {batched / single:.1f}x "
          f"({batched:.0f} vs {single:.0f} steps/s)")


if __name__ == "__main__":
    main()
