"""GRPO: critic-free PPO whose advantage is the episode return z-scored within its prompt group."""

from __future__ import annotations

import torch

from algorithms.base import (ActionScores, BaseAlgorithm, SumReducer, batch_mean_std, reward_kl,
                             token_policy_loss, zero_advantage_rows)
from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.losses import group_index, group_means
from envs.modes import AgentGroups, ScaleRewards, member_of


def group_advantages(
    returns: torch.Tensor, group_ids: torch.Tensor, scale_rewards: ScaleRewards = ScaleRewards.GROUP, eps: float = 1e-4,
    reduce_sum: SumReducer = lambda tensor: tensor,
) -> torch.Tensor:
    """Advantages [B] of episode returns [B] grouped by ``group_ids`` [B] (episodes of one prompt).

    A_i = (R_i - mean_g) / (std + eps), where std is the group's (``group``, GRPO), the whole
    batch's (``batch``) or 1 (``none``, Dr.GRPO: no length/difficulty bias from the division).
    The std is the unbiased sample std, as TRL computes it; ``reduce_sum`` adds the other processes'
    parts of the batch (groups are never split). A group of one (a role that acted in one episode of its
    group) has nothing to compare with: advantage 0. Vectorised with scatter sums.
    """
    scale_rewards = member_of(tuple(ScaleRewards), scale_rewards, "scale_rewards")
    groups, sizes = group_index(group_ids)
    # a group of equal returns has no signal: exactly 0, not the rounding error of its mean (eight returns of
    # 0.3 in float32 average to 0.3 - 3e-8, which the std's eps would scale to advantages of 3e-4)
    spread = (returns.new_zeros(len(sizes)).scatter_reduce(0, groups, returns, "amax", include_self=False)
              - returns.new_zeros(len(sizes)).scatter_reduce(0, groups, returns, "amin", include_self=False))
    centered = torch.where(spread[groups] == 0, 0.0, returns - group_means(returns, groups, sizes)[groups])
    if scale_rewards is ScaleRewards.NONE:
        return centered
    if scale_rewards is ScaleRewards.BATCH:
        return centered / (batch_mean_std(returns, reduce_sum)[1] + eps)
    variances = group_means(centered**2, groups, sizes) * sizes / (sizes - 1).clamp(min=1)  # unbiased
    std = torch.where(sizes > 1, variances.sqrt(), 1.0)  # a group of one: centered is 0, and stays so
    return centered / (std[groups] + eps)


class GRPO(BaseAlgorithm):
    """Critic-free PPO over whole episodes: each episode's summed reward, z-scored within its
    prompt group (``scale_rewards``), is the advantage of every token of every step it took (with
    ``AgentGroups.AT_GRPO``, each step's own reward z-scored among one role's steps at that turn); the
    loss is the per-token clipped surrogate plus ``kl_coef`` * the KL to the reference policy, or that KL
    as a token penalty summed into the episode's reward (``use_kl_in_reward``)."""

    name = "GRPO"

    def advantages(self, buffer: RolloutBuffer) -> AdvantageEstimate:
        """advantages [T, N, A]. By ``agent_groups``: the episode's group advantage on each of its live steps, its
        return compared within (prompt group, agent) (role) or within the prompt group over every agent (joint);
        or each live step's own, its turn's reward compared within (prompt group, agent, turn) (AT-GRPO). Only
        the actions that were taken count in a group."""
        kl = reward_kl(buffer, self.config)
        rewards = buffer.rewards if kl is None else buffer.rewards - self.config.kl_coef * kl.sum(3)  # [T, N, A]
        returns, acted = buffer.episode_returns(rewards), buffer.acted()  # [N, A]
        if self.config.agent_groups == AgentGroups.AT_GRPO:
            scores, scored, group_ids = rewards, buffer.live, buffer.turn_group_ids()
        else:  # one score per episode, [1, N, A]
            per_agent = self.config.agent_groups != AgentGroups.JOINT
            scores, scored, group_ids = returns[None], acted[None], buffer.episode_group_ids(per_agent)[None]
        advantages = torch.zeros_like(scores)
        advantages[scored] = group_advantages(scores[scored], group_ids[scored], self.config.scale_rewards,
                                              reduce_sum=self.reduce_sum)
        stats = {"episode_returns": returns[acted], "advantages": advantages[scored]}
        if kl is not None:
            stats["kl_reward"] = kl[buffer.token_mask()]
        return AdvantageEstimate(advantages * buffer.live, stats=stats)

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return token_policy_loss(scores, batch, batch.advantages[:, None], self.config)

    def skippable_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        return zero_advantage_rows(advantages, self.config)
