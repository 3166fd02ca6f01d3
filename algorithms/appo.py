"""APPO: asynchronous action-level PPO with a critic. Advantages by GAE over env steps."""

from __future__ import annotations

import functools

import torch

from algorithms.base import (ActionScores, BaseAlgorithm, SumReducer, batch_mean_std, clip_stats, decoupled_gae,
                             detached)
from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.losses import clipped_surrogate, kl_k3, masked_mean, value_loss
from envs.modes import LossAgg


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    episode_ends: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over steps; returns (advantages, returns), each [T, ...].

    rewards, values: [T, ...] reward of action t and V(s_t).
    next_values: [T, ...] the value to bootstrap from after action t: V(s_{t+1}) while the episode
        goes on, 0 where it ended.
    episode_ends: [T, ...] 1 where an episode ended (terminated or truncated) after action t, so
        advantages do not flow across episodes.
    delta_t = r_t + gamma * next_value_t - V_t;  A_t = delta_t + gamma * lam * (1 - end_t) * A_{t+1}.
    The loop is over steps (T is small); every env and agent is handled at once.
    """
    deltas = rewards + gamma * next_values - values
    carry = (1.0 - episode_ends.to(rewards.dtype)) * gamma * lam
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    return advantages, advantages + values


class APPO(BaseAlgorithm):
    """Action-level PPO with a critic: GAE over env steps, the clipped ratio on the joint log-prob
    of each action (sum over its tokens), a clipped value loss on V(s_t) and an entropy bonus.
    Asynchronous collection (``--async_rollouts``) lives in the runner: the ratio is always taken
    against the rollout log-probs recorded at generation time."""

    name = "APPO"
    needs_reference = False

    def advantages(self, buffer: RolloutBuffer) -> AdvantageEstimate:
        """advantages (GAE at gae_lambda), returns (at value_lambda): [T, N, A]; advantages normalised over
        the live slots. GAE runs along each agent's own actions (``RolloutBuffer.turn_order``): in a
        multi-agent env other roles act in between, and what they achieve reaches it through its rewards
        and the values it bootstraps from."""
        live, order = buffer.live, buffer.turn_order()
        by_turns = functools.partial(buffer.by_turns, order=order)
        estimate = functools.partial(gae, by_turns(buffer.rewards * live), by_turns(buffer.values),
                                     by_turns(buffer.next_values), by_turns(buffer.episode_ends() | ~live),
                                     self.config.gamma)
        advantages, returns = decoupled_gae(estimate, self.config)
        advantages, returns = buffer.from_turns(advantages, order), buffer.from_turns(returns, order)
        return AdvantageEstimate(normalized(advantages, live, self.reduce_sum), returns, stats={
            "advantages": advantages[live], "returns": returns[live], "values": buffer.values[live]})

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, mask = self.config, batch.token_mask.to(scores.log_probs.dtype)
        log_prob = scores.log_probs.sum(-1)  # [B] joint log-prob of the action
        old_log_prob = batch.old_log_probs.sum(-1)
        surrogate = clipped_surrogate(log_prob - old_log_prob, batch.advantages, config.clip_low, config.clip_high,
                                      config.clip_ratio_c)
        critic_loss = self.value_loss_rows(scores, batch)
        entropy = masked_mean(scores.entropy, mask, dim=-1)  # [B] mean token entropy of each action
        per_sample = surrogate.loss + config.value_coef * critic_loss - config.entropy_coef * entropy
        stats = {"policy_loss": surrogate.loss.mean(), "value_loss": critic_loss.mean(), "entropy": entropy.mean(),
                 **clip_stats(surrogate, torch.ones_like(surrogate.loss), config),
                 "approx_kl": kl_k3(old_log_prob, log_prob).mean()}
        return per_sample.mean() * batch.weight(LossAgg.SEQ_MEAN_TOKEN_MEAN), detached(stats)  # actions weigh the same

    def value_loss_rows(self, scores: ActionScores, batch: Batch) -> torch.Tensor:
        value = scores.values[:, 0]  # V(s_t), read at the last prompt token
        config = self.config
        return value_loss(value, batch.old_values, batch.returns, config.value_clip_param, config.huber_delta)

    def skippable_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        return torch.zeros(advantages.shape[0], dtype=torch.bool)


def normalized(advantages: torch.Tensor, live: torch.Tensor, reduce_sum: SumReducer = lambda tensor: tensor,
               eps: float = 1e-8) -> torch.Tensor:
    """Advantages standardised over the live slots of the whole batch (PPO's per-batch normalisation;
    ``reduce_sum`` adds the other processes' parts), 0 elsewhere."""
    mean, std = batch_mean_std(advantages[live], reduce_sum)
    return torch.where(live, (advantages - mean) / (std + eps), torch.zeros_like(advantages))
