"""The protocol between the env and whatever turns text into reward.

The env calls ``score`` once per env step with every trajectory that completed a step, so a
model-based reward runs one batched forward pass per step, not one per env. No torch here: the
env imports this module, and envs never import training code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from envs.datasets import Problem


@dataclass(frozen=True)
class StepContext:
    """One trajectory at the moment it completed a step.

    ``previous_steps`` are the steps before ``new_step`` (without delimiters); ``done`` is True when
    ``new_step`` ends the episode (final answer, end marker or truncation), which is when outcome
    rewards are paid. ``problem.answer`` is the gold answer: reward models may read it, the policy
    never sees it.
    """

    problem: Problem
    previous_steps: tuple[str, ...]
    new_step: str
    done: bool

    @property
    def steps(self) -> tuple[str, ...]:
        """All steps so far, the new one last."""
        return (*self.previous_steps, self.new_step)


@dataclass
class RewardOutput:
    """What a reward model returns for a batch of B contexts.

    rewards: [B] float, the per-step reward of each context's new step.
    token_rewards: optional list of B arrays [L_b], per-token rewards of the new step (implicit PRM).
    components: named [B] arrays (e.g. per-source rewards of a mixture) for logging.
    correct: optional [B] verdicts of the answer verifier (1.0 / 0.0 for finished contexts, NaN
        for the others), when the model graded anyway; the env then reuses them instead of
        grading the same answers a second time for its accuracy info.
    """

    rewards: np.ndarray
    token_rewards: list[np.ndarray] | None = None
    components: dict[str, np.ndarray] = field(default_factory=dict)
    correct: np.ndarray | None = None


@runtime_checkable
class RewardModel(Protocol):
    """Anything with a ``name`` and a batched ``score``."""

    name: str

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Scores all B contexts in one call; returns ``RewardOutput`` with ``rewards`` of shape [B]."""
        ...
