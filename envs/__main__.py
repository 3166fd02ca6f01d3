"""Env demo: ``python -m envs`` plays Arith-v0 in a 64-env MathVectorEnv with a scripted policy
that follows the reference solution in even envs and writes a wrong final step in odd envs, and
prints what the env paid. (The trainer, ``train_math.py``, replaces the scripted policy.)"""

from __future__ import annotations

import argparse
import time

import gymnasium
import numpy as np

import envs  # noqa: F401  (registers the env ids)
from envs.prompts import split_steps


def scripted_actions(env, steps_done: np.ndarray) -> list[str]:
    problems = {p.id: p for p in env.unwrapped.problems}
    actions = []
    for i, episode in enumerate(env.unwrapped.episodes):
        steps = split_steps(problems[episode.problem.id].solution)
        step = steps[min(steps_done[i], len(steps) - 1)]
        if i % 2 and step.startswith("The answer is"):
            step = f"The answer is \\boxed{{{int(episode.problem.answer) + 1}}}."
        actions.append(step)
    return actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num_envs", type=int, default=64)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--env_steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    env = gymnasium.make_vec("Arith-v0", num_envs=args.num_envs, vectorization_mode="vector_entry_point",
                             group_size=args.group_size)
    obs, info = env.reset(seed=args.seed)
    print(f"{env.num_envs} envs, groups of {args.group_size}; env 0's prompt:\n{obs[0]}")
    finished, correct, total_reward = 0, 0, 0.0
    start = time.perf_counter()
    for _ in range(args.env_steps):
        obs, rewards, terminated, truncated, info = env.step(scripted_actions(env, info["step"]))
        graded = ~np.isnan(info["correct"])  # the envs whose episode ended at this step
        finished += int(graded.sum())
        correct += int(info["correct"][graded].sum())
        total_reward += float(rewards.sum())
    seconds = time.perf_counter() - start
    rate = args.env_steps * env.num_envs / seconds
    print(f"{args.env_steps} vector steps in {seconds:.2f}s ({rate:.0f} env steps/s); "
          f"{finished} episodes, {correct} verified correct ({correct / max(finished, 1):.0%}; "
          f"the scripted policy is right in half the envs), total reward {total_reward:.0f}")


if __name__ == "__main__":
    main()
