"""Env throughput: MathVectorEnv (one batched reward call per step) vs gymnasium's SyncVectorEnv
over N MathEnv (one reward call per env per step), both with the outcome verifier, on the same
scripted actions (each env replays its problem's reference solution, one step per action).

    python bench/env_throughput.py [--num_envs 64] [--steps 300] [--dataset arith|math500]

Prints env steps/s of both and their ratio, and the grader's answers/s on the finished episodes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from gymnasium.vector import SyncVectorEnv

from envs.datasets import MATH500, Arith, load_problems
from envs.grader import grade_batch
from envs.math_env import MathEnv
from envs.prompts import split_steps
from envs.vector import MathVectorEnv



def reference_actions(problems_by_id: dict, problem_ids, step_counts) -> list[str]:
    """Each env's next reference step (the last one again once the solution is used up)."""
    actions = []
    for problem_id, step in zip(problem_ids, step_counts):
        steps = split_steps(problems_by_id[problem_id].solution)
        actions.append(steps[min(int(step), len(steps) - 1)])
    return actions


def run(env, problems_by_id: dict, num_steps: int, seed: int) -> float:
    """Env steps per second over ``num_steps`` vector steps."""
    _, info = env.reset(seed=seed)
    ids, steps = list(info["problem_id"]), np.zeros(env.num_envs, dtype=int)
    start = time.perf_counter()
    for _ in range(num_steps):
        *_, info = env.step(reference_actions(problems_by_id, ids, steps))
        ids, steps = list(info["problem_id"]), np.asarray(info["step"])
    return num_steps * env.num_envs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_envs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300, help="vector steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements of each env")
    parser.add_argument("--dataset", choices=["arith", "math500"], default="arith")
    args = parser.parse_args()

    if args.dataset == "math500":
        problems = load_problems(MATH500)
    else:
        problems = Arith().problems(5000, seed=0)
    by_id = {p.id: p for p in problems}
    batched = MathVectorEnv(num_envs=args.num_envs, problems=problems)
    sync = SyncVectorEnv([lambda: MathEnv(problems=problems) for _ in range(args.num_envs)])
    run(batched, by_id, 20, seed=0)  # warm-up: grader workers, caches
    run(sync, by_id, 20, seed=0)
    rates: dict[str, list[float]] = {"MathVectorEnv": [], "SyncVectorEnv(MathEnv)": []}
    for repeat in range(args.repeats):
        rates["MathVectorEnv"].append(run(batched, by_id, args.steps, seed=repeat))
        rates["SyncVectorEnv(MathEnv)"].append(run(sync, by_id, args.steps, seed=repeat))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, value in medians.items():
        print(f"{name:>24}: {value:9.0f} env steps/s (median of {args.repeats}, N={args.num_envs}, {args.dataset})")

    answers = [p.answer for p in problems[:2000]]
    start = time.perf_counter()
    grade_batch(answers, [p.answer for p in problems[:2000]])
    answers_per_s = len(answers) / (time.perf_counter() - start)
    ratio = medians["MathVectorEnv"] / medians["SyncVectorEnv(MathEnv)"]
    print(f"summary: env_throughput {args.dataset} N={args.num_envs}: MathVectorEnv {medians['MathVectorEnv']:.0f} "
          f"vs SyncVectorEnv {medians['SyncVectorEnv(MathEnv)']:.0f} env steps/s = {ratio:.2f}x; "
          f"grader {answers_per_s:.0f} answers/s on {len(answers)} {args.dataset} gold answers")


if __name__ == "__main__":
    main()
