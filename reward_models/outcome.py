"""The verifier reward: the final answer of a finished trajectory graded against the gold answer."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from envs.grader import extract_answer, grade_batch
from envs.prompts import STEP_DELIMITER
from reward_models.base import RewardOutput, StepContext

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


@dataclass
class OutcomeReward:
    """``correct`` for a verified final answer, ``wrong`` for a wrong one, ``no_answer`` when a
    finished trajectory has none; 0 for steps that do not end the episode. ``format_penalty`` is
    subtracted from a finished trajectory whose answer is not in ``\\boxed{}`` (the format the
    prompt asks for), whatever its correctness.

    All finished trajectories of a batch are graded in one parallel ``grade_batch`` call, each
    bounded by ``timeout`` seconds.
    """

    correct: float = 1.0
    wrong: float = 0.0
    no_answer: float = 0.0
    format_penalty: float = 0.0
    timeout: float = 1.0
    name: str = "outcome"

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Rewards [B]; ``correct`` [B] holds 1.0/0.0 for finished contexts and NaN for the others."""
        answers = [final_answer(c) if c.done else None for c in contexts]
        correct = verify(contexts, answers, timeout=self.timeout)
        rewards = np.where(correct == 1.0, self.correct, self.wrong)
        rewards[[a is None for a in answers]] = self.no_answer
        unboxed = [c.done and BOXED.search(STEP_DELIMITER.join(c.steps)) is None for c in contexts]
        rewards[unboxed] -= self.format_penalty
        rewards[np.isnan(correct)] = 0.0
        return RewardOutput(rewards=rewards, components={self.name: rewards}, correct=correct)


def final_answer(context: StepContext) -> str | None:
    """The extracted final answer of a trajectory's solution so far."""
    return extract_answer(STEP_DELIMITER.join(context.steps))


def verify(contexts: Sequence[StepContext], answers: Sequence[str | None] | None = None,
           timeout: float = 1.0) -> np.ndarray:
    """Verdicts [B]: 1.0 / 0.0 for finished contexts, NaN for unfinished ones; all finished ones
    graded in one parallel ``grade_batch`` call. ``answers`` are pre-extracted final answers."""
    if answers is None:
        answers = [final_answer(c) if c.done else None for c in contexts]
    correct = np.full(len(contexts), np.nan)
    finished = [i for i, c in enumerate(contexts) if c.done]
    correct[finished] = grade_batch([answers[i] for i in finished], [contexts[i].problem.answer for i in finished],
                                    timeout=timeout)
    return correct
