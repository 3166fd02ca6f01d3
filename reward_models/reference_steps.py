"""A rule-based process reward for problems with one canonical step-by-step solution (Arith): the
share of the reference solution's steps the trajectory reproduced, in order, before its first
deviation. It is an exact PRM for such tasks (Math-Shepherd's label convention: a step counts only if
it and every step before it are right), so it needs no model and no parsing of the policy's text
beyond whitespace-stripped string comparison.

Paid as increments: each step earns ``1 / len(reference)`` if it extends the matched prefix, so an
episode's return is the matched share whether the env's action is one step or the whole solution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from envs.prompts import split_steps
from envs.rewards import RewardOutput, StepContext


def matched_prefix(steps: Sequence[str], reference: Sequence[str]) -> int:
    """How many leading ``steps`` equal the ``reference`` steps (whitespace-stripped)."""
    count = 0
    for step, expected in zip(steps, reference):
        if step.strip() != expected.strip():
            break
        count += 1
    return count


@dataclass
class ReferenceStepsReward:
    """Increment of the matched share of ``split_steps(problem.solution)`` per env step; see module docs."""

    name: str = "steps"

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        rewards = np.zeros(len(contexts))
        for i, context in enumerate(contexts):
            reference = split_steps(context.problem.solution or "")
            if not reference:
                raise ValueError(f"problem {context.problem.id!r} has no reference solution; the 'steps' reward "
                                 "needs problems with a canonical step-by-step solution (Arith-v0)")
            before = [s for step in context.previous_steps for s in split_steps(step)]
            steps = before + split_steps(context.new_step)  # a solution-level action holds several steps
            rewards[i] = (matched_prefix(steps, reference) - matched_prefix(before, reference)) / len(reference)
        return RewardOutput(rewards=rewards, sources={self.name: rewards})
