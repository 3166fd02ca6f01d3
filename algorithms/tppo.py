"""TPPO: token-level PPO with action decomposition (BAD, POAD paper arXiv 2405.15821).

A step (action) of L tokens is decomposed into L token decisions. Inside a step there is no
reward and no discount between tokens; across steps the env's reward and gamma apply. The critic
gives a value per token, V_{t,j} = V(prompt_t, first j tokens of action t).
"""

from __future__ import annotations

import functools

import torch

from algorithms.appo import normalized
from algorithms.base import ActionScores, BaseAlgorithm, decoupled_gae, minibatch_share, token_policy_loss
from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.losses import aggregate, discount_matrix, discounted_reverse_cumsum, masked_mean, value_loss


def tppo_advantages(
    rewards: torch.Tensor,
    token_values: torch.Tensor,
    lengths: torch.Tensor,
    next_values: torch.Tensor,
    episode_ends: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns, each [T, N, L] (0 beyond each action's length).

    rewards: [T, N] reward of action t. token_values: [T, N, L] V_{t,j}. lengths: [T, N] tokens
    in action t (>= 1). next_values: [T, N] V_{t+1,first} to bootstrap from after action t (0 where
    the episode ended, terminated or truncated). episode_ends: [T, N] 1 where the episode ended after action t.

    Last token of step t:  delta = r_t + gamma * next_value_t - V_{t,last};
                           A = delta + gamma * lam * (1 - end_t) * A_{t+1,first}.
    Inside the step:       delta = V_{t,j+1} - V_{t,j};  A = delta + lam * A_{t,j+1}.
    R = A + V. Loops over steps only; within a step all envs and tokens go through one
    discounted reverse cumsum (a matmul), so there is no Python loop over tokens.
    """
    num_steps, _, max_len = token_values.shape
    positions = torch.arange(max_len, device=token_values.device)
    valid = positions < lengths[..., None]  # [T, N, L]
    is_last = positions == (lengths[..., None] - 1)
    following_values = torch.cat([token_values[..., 1:], torch.zeros_like(token_values[..., :1])], dim=-1)
    inner_deltas = torch.where(is_last, torch.zeros_like(token_values), following_values - token_values)
    last_values = token_values.gather(-1, (lengths - 1).clamp(min=0)[..., None]).squeeze(-1)  # [T, N]
    last_deltas = rewards + gamma * next_values - last_values
    carry = gamma * lam * (1.0 - episode_ends.to(token_values.dtype))
    weights = discount_matrix(max_len, lam, token_values)  # built once, reused for every step
    advantages = torch.zeros_like(token_values)
    next_first = torch.zeros_like(rewards[0])  # A_{t+1, first}
    for t in reversed(range(num_steps)):
        # The last token's delta takes the step reward and the advantage carried in from step t+1.
        deltas = inner_deltas[t] + is_last[t] * (last_deltas[t] + carry[t] * next_first)[:, None]
        advantages[t] = discounted_reverse_cumsum(deltas * valid[t], lam, weights) * valid[t]
        next_first = advantages[t, :, 0]
    return advantages, (advantages + token_values) * valid


class TPPO(BaseAlgorithm):
    """Token-level PPO with action decomposition: per-token advantages from ``tppo_advantages``
    over the token critic's values, the per-token clipped surrogate masked by true lengths, and a
    per-token (clipped) value loss."""

    name = "TPPO"

    def advantages(self, buffer: RolloutBuffer) -> AdvantageEstimate:
        """advantages (at gae_lambda), returns (at value_lambda): [T, N, A, L]; advantages normalised over
        live tokens. Steps run along each agent's own actions (``RolloutBuffer.turn_order``), as APPO's."""
        num_steps, num_envs, num_agents = buffer.shape
        flat = (num_steps, num_envs * num_agents)
        live, order = buffer.live, buffer.turn_order()

        def by_turns(x: torch.Tensor) -> torch.Tensor:
            return buffer.by_turns(x, order).reshape(*flat, *x.shape[3:])

        estimate = functools.partial(
            tppo_advantages, by_turns(buffer.rewards * live), by_turns(buffer.token_values),
            by_turns(buffer.action_lengths.clamp(min=1)), by_turns(buffer.next_values),
            by_turns(buffer.episode_ends() | ~live), self.config.gamma)
        advantages, returns = decoupled_gae(estimate, self.config)
        mask = buffer.token_mask()
        advantages = buffer.from_turns(advantages.reshape(mask.shape), order)
        returns = buffer.from_turns(returns.reshape(mask.shape), order)
        return AdvantageEstimate(normalized(advantages, mask, self.reduce_sum), returns, stats={
            "advantages": advantages[mask], "returns": returns[mask], "values": buffer.token_values[mask]})

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, mask = self.config, batch.token_mask.to(scores.log_probs.dtype)
        policy_loss, stats = token_policy_loss(scores, batch, batch.advantages, config)
        critic_loss = self.token_value_loss(scores, batch)
        stats["value_loss"] = aggregate(critic_loss, mask, config.loss_agg_mode, config.loss_scale_factor).detach()
        return policy_loss + config.value_coef * minibatch_share(critic_loss, mask, batch, config), stats

    def token_value_loss(self, scores: ActionScores, batch: Batch) -> torch.Tensor:
        """[B, L] the (clipped) value loss of each token's value."""
        config = self.config
        return value_loss(scores.values, batch.old_values, batch.returns, config.value_clip_param, config.huber_delta)

    def value_loss_rows(self, scores: ActionScores, batch: Batch) -> torch.Tensor:
        """[B] each action's mean token value loss."""
        return masked_mean(self.token_value_loss(scores, batch), batch.token_mask.to(scores.log_probs.dtype), dim=-1)

    def skippable_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        return torch.zeros(advantages.shape[0], dtype=torch.bool)
