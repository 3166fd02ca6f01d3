"""The algorithms the trainer knows, and the traits it must know of each before building one.

Torch-free on purpose: a run's configuration is checked against these traits (an episodic algorithm
compares samples within prompt groups; only algorithms with a critic take critic options), and the help texts
name the algorithms with a trait (``named``), before torch is imported. Its modes are the house's
(``envs.modes``), the one module of ``envs`` an algorithm imports. The trainer knows an algorithm only by its
traits, so adding one is a module with a class following ``algorithms.base.Algorithm`` plus one entry in
``ALGORITHMS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from envs.modes import CriticGranularity


@dataclass(frozen=True)
class AlgorithmSpec:
    """``target``: "module:Class" (imported on first use).
    ``episodic``: collect exactly one episode per env per iteration (advantages compare whole episodes
    within a prompt group) instead of ``episode_length`` steps of episodes that span iterations.
    ``critic``: None (no critic) or what the critic values: ``CriticGranularity.ACTION`` (V(s) per step) or
    ``CriticGranularity.TOKEN`` (V per action token).
    ``grouped``: advantages compare the samples of one prompt (a group needs two or more).
    ``token_loss``: the loss takes one ratio per token (else one per action: the KL and loss-aggregation
    options, and per-token rollout weights, mean nothing to it).
    ``scales_rewards``: centred group returns are divided by a std (``ScaleRewards``).
    ``prime``: PRIME's options apply: an implicit PRM, an accuracy filter on oversampled prompt groups.
    ``kl_in_reward``: the KL to the reference is a token reward by default (else a loss term).
    ``asynchronous``: the next batch is generated while this one trains by default (on any device).
    ``turn_groups``: a multi-agent baseline may compare one role's actions at one turn (``AgentGroups.AT_GRPO``).
    ``known_as``: the algorithm's name in the literature, where the registered name cannot spell it."""

    target: str
    episodic: bool
    critic: CriticGranularity | None
    grouped: bool = False
    token_loss: bool = True
    scales_rewards: bool = False
    prime: bool = False
    kl_in_reward: bool = False
    asynchronous: bool = False
    turn_groups: bool = False
    known_as: str | None = None

    @property
    def default_group_size(self) -> int:
        """Samples per prompt when --group_size is left out: a group to compare for an episodic algorithm."""
        return 4 if self.episodic else 1


ALGORITHMS = {
    "APPO": AlgorithmSpec("algorithms.appo:APPO", episodic=False, critic=CriticGranularity.ACTION, token_loss=False,
                          asynchronous=True),
    "GRPO": AlgorithmSpec("algorithms.grpo:GRPO", episodic=True, critic=None, grouped=True, scales_rewards=True,
                          turn_groups=True),
    "TPPO": AlgorithmSpec("algorithms.tppo:TPPO", episodic=False, critic=CriticGranularity.TOKEN),
    "RLOO": AlgorithmSpec("algorithms.rloo:RLOO", episodic=True, critic=None, grouped=True, prime=True),
    "REINFORCE_PP": AlgorithmSpec("algorithms.reinforce_pp:ReinforcePP", episodic=True, critic=None,
                                  kl_in_reward=True, known_as="REINFORCE++ (Hu 2025)"),
    "REINFORCE_PP_BASELINE": AlgorithmSpec("algorithms.reinforce_pp:ReinforcePPBaseline", episodic=True, critic=None,
                                           grouped=True, kl_in_reward=True, known_as="REINFORCE++-baseline (Hu 2025)"),
}


def algorithms_with(trait: Callable[[AlgorithmSpec], bool]) -> tuple[str, ...]:
    """The names of the registered algorithms whose spec has ``trait`` (e.g. ``lambda spec: spec.prime``)."""
    return tuple(name for name, spec in ALGORITHMS.items() if trait(spec))


def named(trait: Callable[[AlgorithmSpec], bool]) -> str:
    """The registered algorithms with ``trait``, as a help text names them (e.g. "APPO/TPPO")."""
    return "/".join(algorithms_with(trait))


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered traits of ``name`` (e.g. "GRPO")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def collects_whole_episodes(spec: AlgorithmSpec, multi_agent: bool) -> bool:
    """Whether each iteration collects one whole episode per env (no autoreset): an episodic algorithm compares
    whole episodes, and in a multi-agent env an agent's action bootstraps from its own next action in the episode."""
    return spec.episodic or multi_agent
