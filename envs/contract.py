"""The env -> trainer contract: what every vector env of this package says about a reset or a step, as
typed arrays over N envs and A agent slots (A = 1 for a single agent).

A vector env has ``agents`` (an ``Agents``: its slots' roles and which a trainer trains) and puts one
``StepFacts`` in ``info[FACTS]`` of every ``reset`` and ``step``: the rewards [N, A] with every reward
source's own share, which slots act next, the verdicts and the ids of the episodes now running. A trainer
reads that record and nothing else of the info. The other info keys are the same facts as plain gymnasium
arrays for other users; the single-agent env's gymnasium rewards stay [N] (``facts.rewards[:, 0]``), the
multi-agent env's are the [N, A] array itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

FACTS = "facts"


@dataclass(frozen=True)
class Agents:
    """The A agent slots of a vector env: ``roles`` (their names; () for the one agent of a single-agent env)
    and ``trainable`` [A] (False: a frozen model speaks for the slot and nothing trains on its actions)."""

    roles: tuple[str, ...] = ()
    trainable: tuple[bool, ...] = (True,)

    @property
    def multi(self) -> bool:
        """Observations are [N][A] prompts and actions [N][A] messages (else [N] of each)."""
        return bool(self.roles)

    @property
    def count(self) -> int:
        return len(self.trainable)


@dataclass(eq=False)
class StepFacts:
    """What a reset or a step says about N envs with A agent slots.

    Of the episodes now running (whose observations are returned): ``problem_ids`` [N] object,
    ``group_ids`` [N] int64, ``turns`` [N] int64 (steps or turns taken), ``acting`` [N, A] bool (the slots
    that act on the next step), ``states`` [N, A] object or None (a centralized critic's view of each acting
    slot; multi-agent envs).

    Of the actions just taken (none at a reset): ``rewards`` [N, A] float64, what each slot was paid, every
    reward source combined; ``return_so_far`` [N, A] float64, each slot's rewards summed over the episode they
    belong to (where an episode ended at this step, its whole return: the one place returns are summed for
    the record; a trainer's own returns are what its buffer kept); ``sources`` {name: [N, A] float64}, each
    source's own reward, NaN where it scored nothing; ``correct`` [N] float64, the verified verdict where an
    episode ended at this step, NaN elsewhere; ``clipped`` [N, A] bool, the action was longer than the env
    keeps; ``outputs`` {metric: [N, A] float64}, each slot's verified output (multi-agent:
    ``envs.multi_agent.ROLE_METRICS``), NaN where it gave none; ``answers`` [N] object, the final answer
    ``correct`` judged (extracted, a str) where an episode ended at this step, None where it had none the
    grader could read, and elsewhere; ``tool_called`` [N, A] bool, the action was a call of the env's tool,
    run (None in an env without a tool, and at a reset).
    """

    problem_ids: np.ndarray
    group_ids: np.ndarray
    turns: np.ndarray
    acting: np.ndarray
    states: np.ndarray | None = None
    rewards: np.ndarray | None = None
    return_so_far: np.ndarray | None = None
    sources: dict[str, np.ndarray] = field(default_factory=dict)
    correct: np.ndarray | None = None
    clipped: np.ndarray | None = None
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    answers: np.ndarray | None = None
    tool_called: np.ndarray | None = None

    def __post_init__(self) -> None:
        """A reset's facts: nothing paid, no verdict or answer, nothing clipped."""
        shape = self.acting.shape
        if self.rewards is None:
            self.rewards = np.zeros(shape)
        if self.return_so_far is None:
            self.return_so_far = np.zeros(shape)
        if self.correct is None:
            self.correct = np.full(shape[0], np.nan)
        if self.clipped is None:
            self.clipped = np.zeros(shape, dtype=bool)
        if self.answers is None:
            self.answers = np.full(shape[0], None, dtype=object)

    def __eq__(self, other: object) -> bool:
        """Field by field, arrays by value (NaN equal to NaN): what gymnasium's ``check_env`` asks of two infos
        of the same seed and actions."""
        if not isinstance(other, StepFacts):
            return NotImplemented
        return all(same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def same(a: Any, b: Any) -> bool:
    """Whether two ``StepFacts`` fields hold the same: arrays of the same shape, dtype and values, or dicts of them."""
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if a is None or b is None:
        return a is b
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
