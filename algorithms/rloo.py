"""RLOO with PRIME's reward combination: leave-one-out baselines computed separately for the
outcome stream (verified answer) and the implicit-PRM process stream (per-token rewards), then
summed and turned into per-token returns (PRIME, arXiv 2502.01456)."""

from __future__ import annotations

import torch

from algorithms.losses import discounted_reverse_cumsum


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense group index [B], group sizes [G]); every group needs >= 2 members for a baseline."""
    _, groups = torch.unique(group_ids, return_inverse=True)
    sizes = torch.bincount(groups)
    if int(sizes.min()) < 2:
        raise ValueError("RLOO needs at least 2 samples per group for a leave-one-out baseline; use group_size >= 2")
    return groups, sizes


def leave_one_out_baseline(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """b_i = mean of the OTHER members' scores in i's group; scores, group_ids, result: [B]."""
    groups, sizes = _group_index(group_ids)
    sums = torch.zeros(len(sizes), dtype=scores.dtype, device=scores.device).index_add_(0, groups, scores)
    return (sums[groups] - scores) / (sizes[groups] - 1).to(scores.dtype)


def rloo_returns(
    outcome: torch.Tensor,
    group_ids: torch.Tensor,
    token_mask: torch.Tensor,
    process: torch.Tensor | None = None,
    outcome_coef: float = 1.0,
    process_coef: float = 1.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Per-token returns [B, L] used as advantages.

    outcome: [B] verified reward of each response, paid at its last token, minus the
        leave-one-out mean of its group's outcomes.
    process: [B, L] implicit-PRM token rewards (optional); each token's reward minus the
        leave-one-out mean, over the group's other responses, of their mean token reward.
    token_mask: [B, L] 1 on each response's real tokens (from true lengths).
    Returns sum_{s >= t} gamma^(s-t) (outcome_coef * a^o_s + process_coef * a^p_s) on real tokens.
    """
    mask = token_mask.to(outcome.dtype)
    lengths = mask.sum(-1).long()
    last_token = torch.nn.functional.one_hot((lengths - 1).clamp(min=0), mask.shape[-1]).to(outcome.dtype) * mask
    centered = outcome_coef * (outcome - leave_one_out_baseline(outcome, group_ids))[:, None] * last_token
    if process is not None:
        mean_process = (process * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        centered = centered + process_coef * (process - leave_one_out_baseline(mean_process, group_ids)[:, None]) * mask
    return discounted_reverse_cumsum(centered, gamma) * mask


def filter_groups(
    correct: torch.Tensor, group_ids: torch.Tensor, accuracy_lower_bound: float, accuracy_upper_bound: float
) -> torch.Tensor:
    """PRIME's online prompt filter: keep mask [B] of responses whose group's accuracy (mean of
    ``correct`` [B]) lies in [lower, upper]; all-right and all-wrong groups teach nothing."""
    groups, sizes = _group_index(group_ids)
    accuracy = torch.zeros(len(sizes), dtype=torch.float64, device=correct.device).index_add_(
        0, groups, correct.to(torch.float64)) / sizes
    keep = (accuracy >= accuracy_lower_bound) & (accuracy <= accuracy_upper_bound)
    return keep[groups]
