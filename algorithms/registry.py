"""The algorithms the trainer knows, and the traits it must know of each before building one.

Torch-free on purpose: the command line checks flags against these traits (an episodic algorithm
compares samples within prompt groups; only algorithms with a critic take critic flags) and resolves
the hyper-parameters (``AlgorithmConfig``) before torch is imported. Its modes are the house's
(``envs.modes``), the one module of ``envs`` an algorithm imports.

Adding an algorithm is a module with a class following ``algorithms.base.Algorithm`` and its entry in
``ALGORITHMS`` (``--algorithm_name`` and the critic and group checks follow from the entry), and more where
the flags name algorithms: ``train.flags.checks.APPLIES_TO`` lists the algorithms that read each
algorithm-specific flag (a new algorithm gets the KL and loss-aggregation flags unless it is excluded from
``TOKEN_LOSS``, as APPO's one ratio per action is), and ``train.resolve`` gives RLOO its oversampling and
APPO asynchronous rollouts by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.modes import AgentGroups, CriticGranularity, ImportanceSamplingLevel, KLEstimator, LossAgg, ScaleRewards


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
    ``turn_groups``: a multi-agent baseline may compare one role's actions at one turn (``AgentGroups.AT_GRPO``)."""

    target: str
    episodic: bool
    critic: CriticGranularity | None
    grouped: bool = False
    turn_groups: bool = False


ALGORITHMS = {
    "APPO": AlgorithmSpec("algorithms.appo:APPO", episodic=False, critic=CriticGranularity.ACTION),
    "GRPO": AlgorithmSpec("algorithms.grpo:GRPO", episodic=True, critic=None, grouped=True, turn_groups=True),
    "TPPO": AlgorithmSpec("algorithms.tppo:TPPO", episodic=False, critic=CriticGranularity.TOKEN),
    "RLOO": AlgorithmSpec("algorithms.rloo:RLOO", episodic=True, critic=None, grouped=True),
    "REINFORCE_PP": AlgorithmSpec("algorithms.reinforce_pp:ReinforcePP", episodic=True, critic=None),
    "REINFORCE_PP_BASELINE": AlgorithmSpec("algorithms.reinforce_pp:ReinforcePPBaseline", episodic=True, critic=None,
                                           grouped=True),
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered traits of ``name`` (e.g. "GRPO")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def collects_whole_episodes(spec: AlgorithmSpec, multi_agent: bool) -> bool:
    """Whether each iteration collects one whole episode per env (no autoreset): an episodic algorithm compares
    whole episodes, and in a multi-agent env an agent's action bootstraps from its own next action in the episode."""
    return spec.episodic or multi_agent
