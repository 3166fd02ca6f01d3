"""The algorithms' hyper-parameters, each declared once: its default, help text and flag name beside it.

Three small sections hold them, one for each --helpfull section they appear in: ``LossOptions`` (advantages and
losses), ``PrimeOptions`` (PRIME's prompt filter and reward streams) and ``MultiAgentOptions`` (what a group
baseline compares). RunConfig's learning, PRIME and multi-agent sections (``train.config``) extend them with the
trainer's own options, so their flags are generated with the rest; ``AlgorithmConfig`` is the three together, as
the run resolved them, plus what is derived from other options (``max_groups``). An algorithm reads only this.

Torch-free on purpose: the flags are generated from these classes before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from algorithms.options import option
from algorithms.registry import algorithm_spec, named
from envs.modes import (LOSS_AGG_ALIASES, AgentGroups, ImportanceSamplingLevel, KLEstimator, LossAgg, ProcessBaseline,
                        ScaleRewards)


@dataclass(frozen=True)
class LossOptions:
    """How advantages are estimated and what the loss holds (the options of --helpfull's algorithm section that
    an algorithm reads)."""

    clip_param: float = option(0.2, "PPO ratio clip epsilon: the ratio is kept within [1 - eps, 1 + eps] "
                               "(--clip_ratio_low / --clip_ratio_high set either side apart).")
    clip_ratio_low: float | None = option(
        None, "Lower clip epsilon: the ratio's floor is 1 - this where the advantage is negative (verl's "
        "clip_ratio_low, TRL's epsilon). Default: --clip_param.")
    clip_ratio_high: float | None = option(
        None, "Upper clip epsilon: the ratio's ceiling is 1 + this where the advantage is positive; above "
        "--clip_ratio_low it is DAPO's clip-higher (e.g. 0.28 over 0.2), room for unlikely tokens to grow (verl's "
        "clip_ratio_high, TRL's epsilon_high). Default: --clip_param.")
    clip_ratio_c: float | None = option(
        None, "Dual-clip (Ye et al. 2020): where the advantage is negative the loss is at most c |A|, so a ratio "
        "far above 1 cannot push the update without bound; > 1, verl uses 3.0 (its clip_ratio_c). Default: off.")
    importance_sampling_level: ImportanceSamplingLevel = option(
        ImportanceSamplingLevel.TOKEN, "The clipped ratio per token, or per action: exp of the mean of its tokens' "
        "log-ratios, clipped as a whole (GSPO, Zheng et al. 2025, which clips at about 3e-4 and 4e-4; TRL's "
        "importance_sampling_level, verl's policy_loss gspo).")
    entropy_coef: float = option(0.0, "Entropy bonus coefficient.")
    value_coef: float = option(0.5, "Value loss coefficient.")
    value_clip_param: float = option(0.2, "Value clip around the collection-time values (0: off).")
    huber_delta: float = option(0.0, "Huber delta of the value loss (0: squared error).")
    gamma: float = option(1.0, "Discount across env steps.")
    gae_lambda: float = option(0.95, "GAE lambda of the policy's advantages.")
    value_lambda: float = option(
        1.0, "GAE lambda of the critic's targets (Decoupled GAE, as VAPO): 1.0 fits V to the returns the rewards "
        "give; below 1 a token j steps before the reward sees it with weight lambda^j and V is fitted mostly to its "
        "own later values.")
    scale_rewards: ScaleRewards = option(ScaleRewards.GROUP, "Divide centred returns by the group's std, the batch's, "
                                         "or nothing (Dr.GRPO).")
    kl_coef: float = option(0.0, "KL-to-reference coefficient beta, in the loss or, with --use_kl_in_reward, in the "
                            "reward (0: no KL and no reference pass).")
    kl_loss_type: KLEstimator = option(
        KLEstimator.K3, "Estimator of the loss's KL term (Schulman's k1, k2, k3; low_var_kl: k3 bounded to [-10, 10] "
        "as verl's; verl's kl_loss_type).")
    use_kl_in_reward: bool | None = option(
        None, "The KL to the reference as a penalty beta * KL_t on every token's reward instead of a loss term "
        "(verl's use_kl_in_reward); algorithms with one advantage per action sum it into the action's reward. "
        f"Default: on for {named(lambda spec: spec.kl_in_reward)}, else off.")
    kl_penalty: KLEstimator = option(KLEstimator.K1, "Estimator of the reward's KL penalty, from the behaviour "
                                     "log-probs (verl's kl_penalty; k1 is verl's 'kl').")
    loss_agg_mode: LossAgg = option(
        LossAgg.TOKEN_MEAN, "How per-token losses become one (verl's names): token-mean (every token weighs the "
        "same, DAPO), seq-mean-token-mean (every action weighs the same, GRPO), seq-mean-token-sum, "
        "seq-mean-token-sum-norm (each action's token sum over a fixed length, --loss_scale_factor: Dr. GRPO). "
        "token_mean and seq_mean: the first two.", aliases=LOSS_AGG_ALIASES)
    loss_scale_factor: int | None = option(
        None, "The fixed length seq-mean-token-sum-norm divides each action's token sum by (verl's "
        "loss_scale_factor). Default with that mode: --max_new_tokens.", lower_bound=1)


@dataclass(frozen=True)
class PrimeOptions:
    """PRIME's options that an algorithm reads: the accuracy and truncation filters on prompt groups and the two
    reward streams."""

    accuracy_lower_bound: float = option(0.2, "PRIME: keep prompts whose group accuracy is >= this.")
    accuracy_upper_bound: float = option(0.8, "PRIME: keep prompts whose group accuracy is <= this.")
    filter_truncated: bool = option(
        False, "PRIME: drop a prompt group holding an answer cut at --max_new_tokens as well (PRIME's "
        "data.filter_truncated, verl recipe's data.filter_truncate), so no answer that never stopped trains the "
        "policy or the implicit PRM; with --filter_groups the rounds go on past such groups.")
    process_coef: float = option(1.0, "PRIME: weight of the implicit-PRM reward stream against the outcome stream's 1 "
                                 "(0: RLOO on the outcome stream alone, and no implicit PRM is built or trained).")
    normalize_advantages: bool = option(True, "RLOO: standardise the summed returns over the batch's trained tokens "
                                        "(mean 0, std 1), as PRIME's code does.")
    reward_baseline: ProcessBaseline = option(
        ProcessBaseline.TOKEN, "PRIME: the implicit-PRM stream's leave-one-out baseline (PURE's name): token takes "
        "the group's other responses' mean reward per token at each token, so a response's process return loses "
        "their mean times its own length (PRIME's code); response takes their mean process return, whatever its "
        "length.")


@dataclass(frozen=True)
class MultiAgentOptions:
    """What a group baseline compares in a multi-agent env."""

    agent_groups: AgentGroups = option(
        AgentGroups.ROLE, "Multi-agent envs, algorithms with a group baseline: it compares one role's episodes of one "
        "problem, each scored by its return (role, normalised per role), or every role's episodes of the problem "
        f"together (joint, MAGRPO's team baseline); {named(lambda spec: spec.turn_groups)} only: at_grpo "
        "(PettingLLMs' AT-GRPO, agent- and turn-wise) "
        "compares one role's actions at one turn of one problem, each scored by the reward of its own turn.")


@dataclass(frozen=True)
class AlgorithmConfig(LossOptions, PrimeOptions, MultiAgentOptions):
    """Hyper-parameters shared by the algorithms (each reads the ones it needs): the options above, and
    ``max_groups``, the prompt groups RLOO keeps after filtering an oversampled batch (this rank's share of
    --n_rollout_threads / --group_size; None: every group that passes). ``use_kl_in_reward`` left None is the
    algorithm's default, which ``algorithms.base.make_algorithm`` resolves (``kl_in_reward``)."""

    max_groups: int | None = None

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


def kl_in_reward(use_kl_in_reward: bool | None, algorithm: str) -> bool:
    """--use_kl_in_reward, or its default: the algorithm's own (a token reward for REINFORCE++), else off."""
    return algorithm_spec(algorithm).kl_in_reward if use_kl_in_reward is None else use_kl_in_reward
