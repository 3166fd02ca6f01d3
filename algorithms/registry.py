"""The algorithms the trainer knows, and the traits it must know of each before building one.

Torch-free on purpose: the command line checks flags against these traits (an episodic algorithm
compares samples within prompt groups; only algorithms with a critic take critic flags) and resolves
the hyper-parameters (``AlgorithmConfig``) before torch is imported. Adding an algorithm is a module
with a class following ``algorithms.base.Algorithm`` plus one entry in ``ALGORITHMS``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

CRITICS = (None, "action", "token")


class ScaleRewards(enum.StrEnum):
    """What centred group returns are divided by (GRPO)."""

    GROUP = "group"  # the group's std
    BATCH = "batch"  # the batch's std
    NONE = "none"  # nothing (Dr.GRPO)


class LossAgg(enum.StrEnum):
    """How per-token losses become one number."""

    TOKEN_MEAN = "token_mean"  # the mean over every action token of the minibatch
    SEQ_MEAN = "seq_mean"  # each action's token mean, then the mean over actions


@dataclass(frozen=True)
class AlgorithmConfig:
    """Hyper-parameters shared by the algorithms (each reads the ones it needs)."""

    clip_param: float = 0.2
    value_clip_param: float | None = 0.2  # None: no value clipping
    huber_delta: float | None = None  # None: 0.5 * squared error
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    gamma: float = 1.0
    gae_lambda: float = 0.95  # the policy's advantages
    value_lambda: float = 1.0  # the critic's targets (returns); 1.0 = Monte Carlo, free of the critic's own bias
    scale_rewards: ScaleRewards = ScaleRewards.GROUP
    kl_coef: float = 0.0
    loss_agg: LossAgg = LossAgg.TOKEN_MEAN
    process_coef: float = 0.2  # RLOO: weight of the implicit-PRM stream
    accuracy_lower_bound: float = 0.2  # RLOO: PRIME's prompt filter
    accuracy_upper_bound: float = 0.8
    max_groups: int | None = None  # RLOO: groups kept after filtering an oversampled batch
    joint_groups: bool = False  # multi-agent GRPO/RLOO: one baseline over all agents of a prompt group (MAGRPO)


@dataclass(frozen=True)
class AlgorithmSpec:
    """``target``: "module:Class" (imported on first use).
    ``episodic``: collect exactly one episode per env per iteration (advantages compare whole episodes
    within a prompt group) instead of ``episode_length`` steps of episodes that span iterations.
    ``critic``: None, "action" (V(s) per step) or "token" (V per action token)."""

    target: str
    episodic: bool
    critic: str | None


ALGORITHMS = {
    "APPO": AlgorithmSpec("algorithms.appo:APPO", episodic=False, critic="action"),
    "GRPO": AlgorithmSpec("algorithms.grpo:GRPO", episodic=True, critic=None),
    "TPPO": AlgorithmSpec("algorithms.tppo:TPPO", episodic=False, critic="token"),
    "RLOO": AlgorithmSpec("algorithms.rloo:RLOO", episodic=True, critic=None),
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered traits of ``name`` (e.g. "GRPO")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
