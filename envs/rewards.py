"""The reward contract between the env and whatever turns text into reward, the env's default reward
(the verified final answer) and the weighted mixture of reward sources that ``--reward`` names.

The env calls ``score`` once per env step with every trajectory that completed a step, so a
model-based reward runs one batched forward pass per step, not one per env. Every env combines its
sources with ``RewardMixture.combine``: the single-agent env through ``score``, the multi-agent env with
its own "outcome" source (the workflow's verified outcome, credited to the roles) beside the scored
ones. No torch here: envs never import training code, and model-based rewards (``reward_models``)
implement this protocol from above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from envs.datasets import Problem
from envs.grader import extract_answer, grade_batch, reasoning_gym_scores, scorer_packages
from envs.modes import Grader
from envs.prompts import STEP_DELIMITER


@dataclass(frozen=True)
class StepContext:
    """One trajectory at the moment it completed a step.

    ``previous_steps`` are the steps before ``new_step`` (without delimiters); ``done`` is True when
    ``new_step`` ends the episode (final answer, end marker or truncation), which is when outcome
    rewards are paid. ``problem.answer`` is the gold answer: reward models may read it, the policy
    never sees it. ``group_id`` names the episode's draw of its problem, unique in the run and the same
    however the envs are split over processes: what a reward model that samples seeds from.
    """

    problem: Problem
    previous_steps: tuple[str, ...]
    new_step: str
    done: bool
    group_id: int = 0

    @property
    def steps(self) -> tuple[str, ...]:
        """All steps so far, the new one last."""
        return (*self.previous_steps, self.new_step)


@dataclass
class RewardOutput:
    """What a reward model returns for a batch of B contexts.

    rewards: [B] float, the per-step reward of each context's new step.
    sources: named [B] arrays (e.g. per-source rewards of a mixture) for logging.
    correct: optional [B] verdicts of the answer verifier (1.0 / 0.0 for finished contexts, NaN
        for the others), when the model graded anyway; the env then reuses them instead of
        grading the same answers a second time for its accuracy info.
    """

    rewards: np.ndarray
    sources: dict[str, np.ndarray] = field(default_factory=dict)
    correct: np.ndarray | None = None


@runtime_checkable
class RewardModel(Protocol):
    """Anything with a ``name`` and a batched ``score``."""

    name: str

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Scores all B contexts in one call; returns ``RewardOutput`` with ``rewards`` of shape [B]."""
        ...


class RewardModelError(RuntimeError):
    """A reward model raised while scoring a batch; the message names the model and the batch."""

    def __init__(self, reward_model: RewardModel, contexts: Sequence[StepContext], error: Exception):
        ids = list(dict.fromkeys(c.problem.id for c in contexts))  # a group's samples share a problem
        shown = ", ".join(ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
        super().__init__(f"reward model {getattr(reward_model, 'name', '?')!r} ({type(reward_model).__name__}) "
                         f"raised {type(error).__name__}: {error} while scoring a batch of {len(contexts)} steps "
                         f"of problems [{shown}]")


def score_batch(reward_model: RewardModel, contexts: Sequence[StepContext]) -> RewardOutput:
    """``reward_model.score(contexts)``, its rewards checked to be [B] (one per context); an exception it
    raises comes back as a ``RewardModelError`` naming the model and the batch's problems."""
    try:
        output = reward_model.score(contexts)
    except RewardModelError:
        raise  # a mixture's source already named itself
    except Exception as error:
        raise RewardModelError(reward_model, contexts, error) from error
    shape = np.shape(output.rewards)
    if shape != (len(contexts),):
        raise ValueError(f"reward model {getattr(reward_model, 'name', '?')!r} returned rewards of shape {shape} for "
                         f"a batch of {len(contexts)} steps; score() must return one reward per context")
    return output


class RewardMixture:
    """sum_k weight_k * reward_k over the given models (keyed by source name)."""

    name = "mixture"

    def __init__(self, models: Mapping[str, RewardModel], weights: Mapping[str, float]):
        missing = set(weights) - set(models)
        if not weights:
            raise ValueError("a RewardMixture needs at least one source weight, e.g. {'outcome': 1.0}")
        if missing:
            raise ValueError(f"reward weights name {sorted(missing)} but no model was built for them")
        self.models = {name: models[name] for name in weights}
        self.weights = dict(weights)

    @classmethod
    def of(cls, model: RewardModel) -> RewardMixture:
        """``model`` as a mixture: itself when it is one, else its one source at weight 1."""
        return model if isinstance(model, RewardMixture) else cls({model.name: model}, {model.name: 1.0})

    def combine(self, rewards: Mapping[str, np.ndarray]) -> np.ndarray:
        """The weighted sum (float64, any shape) of every source's rewards ``rewards[name]``."""
        total = np.zeros(np.shape(rewards[next(iter(self.weights))]), dtype=np.float64)
        for name, weight in self.weights.items():
            total += weight * np.asarray(rewards[name], dtype=np.float64)
        return total

    def score_each(self, contexts: Sequence[StepContext], skip: Sequence[str] = ()) -> dict[str, RewardOutput]:
        """Every source's own ``RewardOutput`` for the batch (each scoring it once, through ``score_batch``, so
        that a failing source is the one named), but those in ``skip``."""
        return {name: score_batch(model, contexts) for name, model in self.models.items() if name not in skip}

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Weighted sum [B] of every source's reward; ``sources`` holds what each source reported and its
        own reward under its name; ``correct`` comes from the last source that gives it."""
        outputs = self.score_each(contexts)
        sources: dict[str, np.ndarray] = {}
        correct = None
        for name, output in outputs.items():
            sources.update({key: np.asarray(value) for key, value in output.sources.items()})
            sources.setdefault(name, np.asarray(output.rewards, dtype=np.float64))
            correct = output.correct if output.correct is not None else correct
        rewards = self.combine({name: output.rewards for name, output in outputs.items()})
        return RewardOutput(rewards=rewards, sources=sources, correct=correct)


BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


@dataclass
class OutcomeReward:
    """``correct`` for a verified final answer, ``wrong`` for a wrong one, ``no_answer`` when a
    finished trajectory has none; 0 for steps that do not end the episode. ``format_penalty`` is
    subtracted from a finished trajectory whose answer is not in ``\\boxed{}`` (the format the
    prompt asks for), whatever its correctness.

    All finished trajectories of a batch are graded in one parallel call (``outcome_scores``: by ``grader``, or
    by the problem's own scorer, whose partial credit s in [0, 1] pays ``wrong + s * (correct - wrong)``), each
    bounded by ``timeout`` seconds.
    """

    correct: float = 1.0
    wrong: float = 0.0
    no_answer: float = 0.0
    format_penalty: float = 0.0
    timeout: float = 1.0
    grader: Grader = Grader.MATHRL
    name: str = "outcome"

    def __post_init__(self):
        scorer_packages(self.grader)  # math-verify installed, else the ImportError naming its extra

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Rewards [B]; ``correct`` [B] holds 1.0/0.0 for finished contexts and NaN for the others."""
        answers = [final_answer(c) if c.done else None for c in contexts]
        scores = outcome_scores(contexts, answers, timeout=self.timeout, grader=self.grader)
        correct = verdicts(scores)
        rewards = self.wrong + (self.correct - self.wrong) * np.nan_to_num(scores)
        rewards[[a is None for a in answers]] = self.no_answer
        unboxed = [c.done and BOXED.search(STEP_DELIMITER.join(c.steps)) is None for c in contexts]
        rewards[unboxed] -= self.format_penalty
        rewards[np.isnan(correct)] = 0.0
        return RewardOutput(rewards=rewards, sources={self.name: rewards}, correct=correct)


def final_answer(context: StepContext) -> str | None:
    """The extracted final answer of a trajectory's solution so far."""
    return extract_answer(STEP_DELIMITER.join(context.steps))


def verify(contexts: Sequence[StepContext], answers: Sequence[str | None] | None = None,
           timeout: float = 1.0, grader: Grader = Grader.MATHRL) -> np.ndarray:
    """Verdicts [B]: 1.0 / 0.0 for finished contexts (1.0: full marks, see ``outcome_scores``), NaN for
    unfinished ones. ``answers`` are pre-extracted final answers."""
    return verdicts(outcome_scores(contexts, answers, timeout, grader))


def verdicts(scores: np.ndarray) -> np.ndarray:
    """1.0 where a score [B] is full marks, 0.0 where it is less, NaN where it is NaN (not finished)."""
    return np.where(np.isnan(scores), np.nan, scores == 1.0)


def outcome_scores(contexts: Sequence[StepContext], answers: Sequence[str | None] | None = None,
                   timeout: float = 1.0, grader: Grader = Grader.MATHRL) -> np.ndarray:
    """Scores [B] in [0, 1] of finished contexts, NaN for unfinished ones: a problem with a scorer of its own
    (``Problem.scorer``: a reasoning-gym dataset's, partial credit included) by that scorer, every other by
    ``grader``'s verdict on its reference answer; each kind in one parallel call to the grading workers, each
    answer bounded by ``timeout`` seconds. ``answers`` are pre-extracted final answers."""
    if answers is None:
        answers = [final_answer(c) if c.done else None for c in contexts]
    scores = np.full(len(contexts), np.nan)
    finished = [i for i, c in enumerate(contexts) if c.done]
    own = [i for i in finished if contexts[i].problem.scorer is not None]
    graded = [i for i in finished if contexts[i].problem.scorer is None]
    scores[graded] = grade_batch([answers[i] for i in graded], [contexts[i].problem.answer for i in graded],
                                 timeout=timeout, grader=grader)
    scores[own] = reasoning_gym_scores([answers[i] for i in own], [contexts[i].problem.scorer for i in own],
                                       timeout=timeout)
    return scores


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
    at Scale", eq. 13), as verl's ``overlong_buffer`` pays it on top of the reward, per action of ``|y|`` tokens
    with a limit of L_max = ``max_length`` tokens and a buffer of L_cache = ``buffer_length``:

        R_length(y) = 0                                              |y| <= L_max - L_cache
                    = penalty_factor * ((L_max - L_cache) - |y|) / L_cache    L_max - L_cache < |y| <= L_max

    so the penalty grows linearly over the buffer to -penalty_factor at the limit (the generator never
    exceeds it). Paid by the trainer on token counts, not by the env: gymnasium users get the env's reward."""

    max_length: int
    buffer_length: int
    penalty_factor: float = 1.0

    def __post_init__(self):
        if not 0 < self.buffer_length <= self.max_length:
            raise ValueError(f"overlong buffer_length={self.buffer_length} must be in (0, max_length="
                             f"{self.max_length}]")

    def __call__(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Penalties [B] (<= 0) of actions of ``lengths`` [B] tokens."""
        excess = np.asarray(lengths, dtype=np.float64) - (self.max_length - self.buffer_length)
        return np.minimum(-excess / self.buffer_length * self.penalty_factor, 0.0)
