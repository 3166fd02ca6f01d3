"""The algorithms the trainer knows, and the traits it must know of each before building one.

Torch-free on purpose: a run's configuration is checked against these traits (an episodic algorithm
compares samples within prompt groups; only algorithms with a critic take critic options) and its
hyper-parameters (``AlgorithmConfig``) are resolved before torch is imported. Its modes are the house's
(``envs.modes``), the one module of ``envs`` an algorithm imports. The trainer knows an algorithm only by its
traits, so adding one is a module with a class following ``algorithms.base.Algorithm`` plus one entry in
``ALGORITHMS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from envs.modes import AgentGroups, CriticGranularity, ImportanceSamplingLevel, KLEstimator, LossAgg, ScaleRewards


@dataclass(frozen=True)
class AlgorithmConfig:
    """Hyper-parameters shared by the algorithms (each reads the ones it needs)."""

    clip_param: float = 0.2
    value_clip_param: float = 0.2  # 0: no value clipping
    huber_delta: float = 0.0  # 0: 0.5 * squared error
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    gamma: float = 1.0
    gae_lambda: float = 0.95  # the policy's advantages
    value_lambda: float = 1.0  # the critic's targets (returns); 1.0 = Monte Carlo, free of the critic's own bias
    scale_rewards: ScaleRewards = ScaleRewards.GROUP
    kl_coef: float = 0.0
    kl_loss_type: KLEstimator = KLEstimator.K3  # the KL term of the loss
    use_kl_in_reward: bool = False  # the KL as a token penalty in the reward instead of a loss term
    kl_penalty: KLEstimator = KLEstimator.K1  # the reward penalty's estimator, on the rollout log-probs
    clip_ratio_low: float | None = None  # None: clip_param
    clip_ratio_high: float | None = None  # None: clip_param (DAPO's clip-higher: above clip_ratio_low)
    clip_ratio_c: float | None = None  # dual-clip bound (> 1) on the ratio where the advantage is negative; None: off
    importance_sampling_level: ImportanceSamplingLevel = ImportanceSamplingLevel.TOKEN
    loss_agg_mode: LossAgg = LossAgg.TOKEN_MEAN
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's divisor (the longest action, max_new_tokens)
    process_coef: float = 1.0  # RLOO: weight of the implicit-PRM stream (the outcome stream's is 1)
    normalize_advantages: bool = True  # RLOO: returns standardised over the batch's trained tokens
    accuracy_lower_bound: float = 0.2  # RLOO: PRIME's prompt filter
    accuracy_upper_bound: float = 0.8
    max_groups: int | None = None  # RLOO: groups kept after filtering an oversampled batch
    agent_groups: AgentGroups = AgentGroups.ROLE  # multi-agent: what a group baseline compares

    @property
    def clip_low(self) -> float:
        return self.clip_param if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_param if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def kl_in_loss(self) -> bool:
        """Whether the loss has a KL-to-reference term (else the KL, if any, is a reward penalty)."""
        return self.kl_coef > 0 and not self.use_kl_in_reward


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
    ``turn_groups``: a multi-agent baseline may compare one role's actions at one turn (``AgentGroups.AT_GRPO``)."""

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
                                  kl_in_reward=True),
    "REINFORCE_PP_BASELINE": AlgorithmSpec("algorithms.reinforce_pp:ReinforcePPBaseline", episodic=True, critic=None,
                                           grouped=True, kl_in_reward=True),
}


def algorithms_with(trait: Callable[[AlgorithmSpec], bool]) -> tuple[str, ...]:
    """The names of the registered algorithms whose spec has ``trait`` (e.g. ``lambda spec: spec.prime``)."""
    return tuple(name for name, spec in ALGORITHMS.items() if trait(spec))


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered traits of ``name`` (e.g. "GRPO")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def collects_whole_episodes(spec: AlgorithmSpec, multi_agent: bool) -> bool:
    """Whether each iteration collects one whole episode per env (no autoreset): an episodic algorithm compares
    whole episodes, and in a multi-agent env an agent's action bootstraps from its own next action in the episode."""
    return spec.episodic or multi_agent
