"""APPO: asynchronous action-level PPO with a critic. Advantages by GAE over env steps."""

from __future__ import annotations

import torch


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
        goes on or was truncated (the value of its last observation), 0 where it terminated.
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
