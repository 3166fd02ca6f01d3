"""REINFORCE++ and REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): critic-free PPO whose token advantages
are returns-to-go of token rewards (the outcome at the end, a KL penalty on every token), normalised over
the whole batch instead of within a prompt group; the baseline variant first subtracts the group's mean
outcome."""

from __future__ import annotations

import torch

from algorithms.appo import normalized
from algorithms.base import ActionScores, BaseAlgorithm, reward_kl, token_policy_loss, zero_advantage_rows
from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.losses import discounted_reverse_cumsum, group_index, group_means
from envs.modes import AgentGroups


def reinforce_pp_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                         group_ids: torch.Tensor | None = None, kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token returns [B, K] of B episodes, each one contiguous sequence of K token positions.

    rewards: [B, K] the env's rewards, each at the last token of the step it paid for. mask: [B, K] 1 on real
    tokens, first in time order. kl_penalty: [B, K] beta * KL_t, paid by every token (None: no penalty).
    group_ids: [B] (REINFORCE++-baseline) the mean over the episode's group of the summed rewards is
    subtracted at the episode's last token (a group of one subtracts its own: 0).

        r_t = rewards_t - [t = last] mean_group(sum rewards) - beta KL_t
        G_t = sum_{s >= t} gamma^(s - t) r_s                                 (Hu 2025)
    """
    mask = mask.to(rewards.dtype)
    token_rewards = rewards * mask
    if group_ids is not None:
        groups, sizes = group_index(group_ids)
        baseline = group_means(token_rewards.sum(-1), groups, sizes)[groups]  # [B]
        lengths = mask.sum(-1).long()
        last_token = torch.nn.functional.one_hot((lengths - 1).clamp(min=0), mask.shape[-1]).to(mask.dtype) * mask
        token_rewards = token_rewards - baseline[:, None] * last_token
    if kl_penalty is not None:
        token_rewards = token_rewards - kl_penalty * mask
    return discounted_reverse_cumsum(token_rewards, gamma) * mask


class ReinforcePP(BaseAlgorithm):
    """REINFORCE++: the advantage of token t is its return-to-go G_t (``reinforce_pp_returns``), standardised over
    every real token of the batch, (G - mean) / (std + 1e-8), across ranks; the loss is the per-token clipped
    surrogate. The KL to the reference (``kl_coef``) is a token reward penalty unless ``use_kl_in_reward`` is off.
    Groups are not compared: ``group_size`` 1 is allowed."""

    name = "REINFORCE_PP"
    subtract_group_mean = False

    def advantages(self, buffer: RolloutBuffer) -> AdvantageEstimate:
        """advantages [T, N, A, L]."""
        config = self.config
        order, token_mask = buffer.episode_token_order()  # [E, T * L]
        positions = torch.arange(buffer.max_action_tokens, device=buffer.device)
        step_ends = (positions == buffer.action_lengths[..., None] - 1) & buffer.live[..., None]
        rewards = buffer.to_episodes(step_ends * buffer.rewards[..., None], order)
        kl = reward_kl(buffer, config)
        penalty = None if kl is None else config.kl_coef * buffer.to_episodes(kl, order)
        acted = buffer.acted().flatten()  # [E]: episodes of agents that never acted have no tokens and no group
        group_ids = buffer.episode_group_ids(per_agent=config.agent_groups != AgentGroups.JOINT).flatten()
        returns = torch.zeros_like(rewards)
        returns[acted] = reinforce_pp_returns(rewards[acted], token_mask[acted], config.gamma,
                                              group_ids[acted] if self.subtract_group_mean else None,
                                              None if penalty is None else penalty[acted])
        advantages = buffer.from_episodes(normalized(returns, token_mask, self.reduce_sum), order)
        stats = {"episode_returns": buffer.episode_returns().flatten()[acted],
                 "advantages": advantages[buffer.token_mask()]}
        if kl is not None:
            stats["kl_reward"] = kl[buffer.token_mask()]
        return AdvantageEstimate(advantages, stats=stats)

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return token_policy_loss(scores, batch, batch.advantages, self.config)

    def skippable_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        return zero_advantage_rows(advantages, self.config)


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++-baseline: REINFORCE++ with each episode's summed reward centred on its prompt group's mean
    before the returns and the batch-wide standardisation (robust to reward scales that differ per prompt)."""

    name = "REINFORCE_PP_BASELINE"
    subtract_group_mean = True
