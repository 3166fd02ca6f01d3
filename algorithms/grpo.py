"""GRPO: critic-free PPO whose advantage is the episode return z-scored within its prompt group."""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(
    returns: torch.Tensor, group_ids: torch.Tensor, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Advantages [B] of episode returns [B] grouped by ``group_ids`` [B] (episodes of one prompt).

    A_i = (R_i - mean_g) / (std + eps), where std is the group's (``group``, GRPO), the whole
    batch's (``batch``) or 1 (``none``, Dr.GRPO: no length/difficulty bias from the division).
    The std is the unbiased sample std, as TRL computes it. Vectorised with scatter sums.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} must be one of {SCALE_REWARDS}")
    _, groups = torch.unique(group_ids, return_inverse=True)
    num_groups = int(groups.max()) + 1
    counts = torch.zeros(num_groups, dtype=returns.dtype, device=returns.device).index_add_(0, groups, torch.ones_like(returns))
    means = torch.zeros_like(counts).index_add_(0, groups, returns) / counts
    centered = returns - means[groups]
    if scale_rewards == "none":
        return centered
    if scale_rewards == "batch":
        return centered / (returns.std() + eps)
    if int(counts.min()) < 2:
        raise ValueError("scale_rewards='group' needs at least 2 episodes per group; use group_size >= 2")
    variances = torch.zeros_like(counts).index_add_(0, groups, centered**2) / (counts - 1)
    return centered / (variances.sqrt()[groups] + eps)
