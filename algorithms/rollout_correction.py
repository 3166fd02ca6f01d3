"""Rollout correction: the gap between the log-probs the sampler recorded (vLLM, a server, an asynchronous
copy of the policy) and the trainer's own scores of the same tokens, and the importance weights that correct
the policy gradient for it.

With the trainer's log-probs pi_t (taken before the update) and the sampler's pi_s, the ratio of the
update is taken against pi_t (decoupled PPO) and each action's policy-gradient term is multiplied by a
weight of rho = pi_t / pi_s, at one of three levels (verl's ``rollout_is_level``):

    token:      rho_{i,j} = exp(log pi_t(y_ij) - log pi_s(y_ij))
    sequence:   rho_i = exp(sum_j (log pi_t(y_ij) - log pi_s(y_ij)))
    geometric:  rho_i = exp(mean_j (log pi_t(y_ij) - log pi_s(y_ij)))

``truncate`` (Truncated Importance Sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training"): w = min(rho, C). ``mask`` (verl's ``rollout_is_mode mask``): an action whose
rho leaves [lower, upper] is dropped from the loss.
"""

from __future__ import annotations

import math

import torch

from algorithms.buffer import Batch
from algorithms.losses import kl_k3, masked_sum
from envs.modes import RolloutIsLevel, member_of


def log_ratio(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, level: RolloutIsLevel) -> torch.Tensor:
    """log rho at ``level``: [B, L] per token, or [B, 1] per action (sequence: the sum of its tokens' log
    ratios; geometric: their mean). ``trainer``, ``sampler``: [B, L] log-probs; ``mask``: [B, L] real tokens."""
    level = member_of(tuple(RolloutIsLevel), level, "rollout_is_level")
    difference = (trainer - sampler) * mask
    if level is RolloutIsLevel.TOKEN:
        return difference
    if level is RolloutIsLevel.SEQUENCE:
        return difference.sum(-1, keepdim=True)
    return difference.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # geometric


def truncated_weights(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS weights min(rho, cap), computed without overflow (a sequence's rho can exceed float range)."""
    return torch.exp(log_rho.clamp(max=math.log(cap)))


def within_band(log_rho: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """[B] True where the action's rho ([B, 1]) lies in [lower, upper]."""
    return ((log_rho >= math.log(lower)) & (log_rho <= math.log(upper))).squeeze(-1)


def rollout_weighted(policy_loss: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The per-token policy-gradient loss [B, L] times the batch's rollout-correction weights ([B, L] or [B, 1];
    as verl applies them, after clipping), or unchanged without."""
    return policy_loss if batch.rollout_weights is None else policy_loss * batch.rollout_weights


def gap_sums(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the real tokens (``mask`` [B, L]) of |log pi_t - log pi_s| and of the k3 estimate of
    KL(pi_s || pi_t) (Schulman: rho - 1 - log rho, rho = pi_t / pi_s, the tokens drawn from pi_s), the token
    count, and the largest rho: what the logged means and maximum are taken from, over micro-batches and ranks."""
    mask = mask.to(trainer.dtype)
    difference = (trainer - sampler) * mask
    largest = torch.where(mask > 0, difference, -math.inf).max() if mask.any() else difference.new_tensor(-math.inf)
    return {"abs_diff": masked_sum(difference.abs(), mask), "kl": masked_sum(kl_k3(sampler, trainer), mask),
            "tokens": mask.sum(), "max_ratio": torch.exp(largest)}
