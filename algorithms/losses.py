"""The shared math of every algorithm: masked reductions, the one clipped surrogate, the value
loss, KL estimators and discounted sums. Pure functions on tensors; no models, no I/O."""

from __future__ import annotations

import torch

from algorithms.registry import LossAgg

LOSS_AGGREGATIONS = tuple(mode.value for mode in LossAgg)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 where nothing is unmasked)."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduces a per-token loss [B, L] to a scalar.

    token_mean: every unmasked token weighs the same (long answers weigh more, as in DAPO/Dr.GRPO).
    seq_mean: mean over each sequence's tokens, then over sequences (GRPO's original form).
    """
    if mode == "token_mean":
        return masked_mean(loss, mask)
    if mode == "seq_mean":
        return masked_mean(loss, mask, dim=-1).mean()
    raise ValueError(f"loss aggregation {mode!r} must be one of {LOSS_AGGREGATIONS}")


def group_index(group_ids: torch.Tensor, min_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense group index [B] in 0..G-1, group sizes [G]) of ``group_ids`` [B]; every group must have
    at least ``min_size`` members (group baselines need >= 2)."""
    _, groups = torch.unique(group_ids, return_inverse=True)
    sizes = torch.bincount(groups)
    if len(sizes) and int(sizes.min()) < min_size:
        raise ValueError(f"a group has {int(sizes.min())} sample(s), fewer than the {min_size} a group baseline "
                         f"needs; use group_size >= {min_size}")
    return groups, sizes


def group_means(values: torch.Tensor, groups: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Mean [G] of ``values`` [B] within each group (``groups``, ``sizes`` from ``group_index``)."""
    return torch.zeros(len(sizes), dtype=values.dtype, device=values.device).index_add_(0, groups, values) / sizes


def clipped_surrogate(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, clip_param: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss, elementwise: -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A).

    All inputs broadcast to the same shape (e.g. [B] for action-level, [B, L] for tokens); the
    ratio is against ``old_log_probs``, the behaviour log-probs recorded when sampling. Returns
    (loss, clipped) where ``clipped`` is 1.0 where the clipped term was the active one.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_param, 1.0 + clip_param) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).to(unclipped.dtype)


def huber(error: torch.Tensor, delta: float) -> torch.Tensor:
    """0.5 e^2 for |e| <= delta, delta (|e| - delta/2) beyond: quadratic near 0, linear in |e| far
    out, on both sides of zero (the absolute value matters for negative errors)."""
    abs_error = error.abs()
    return torch.where(abs_error <= delta, 0.5 * error**2, delta * (abs_error - 0.5 * delta))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip_param: float | None,
    huber_delta: float | None = None,
) -> torch.Tensor:
    """Elementwise critic loss: max(f(R - V), f(R - V_clipped)) with V_clipped kept within
    ``clip_param`` of the values at collection time (no clipping if None); f is the Huber loss with
    ``huber_delta`` or 0.5 * squared error."""
    def f(error: torch.Tensor) -> torch.Tensor:
        return huber(error, huber_delta) if huber_delta is not None else 0.5 * error**2

    loss = f(returns - values)
    if clip_param is None:
        return loss
    clipped_values = old_values + (values - old_values).clamp(-clip_param, clip_param)
    return torch.maximum(loss, f(returns - clipped_values))


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per sample: exp(d) - d - 1 with d = log ref - log pi.
    Unbiased, always >= 0, low variance; GRPO's KL penalty."""
    log_ratio = ref_log_probs - log_probs
    return torch.exp(log_ratio) - log_ratio - 1.0


def discount_matrix(length: int, discount: float, like: torch.Tensor) -> torch.Tensor:
    """[L, L] upper-triangular W with W[k, j] = discount^(k - j) for k >= j, else 0 (dtype/device of ``like``)."""
    positions = torch.arange(length, device=like.device)
    offsets = positions[:, None] - positions[None, :]  # [k, j] = k - j
    powers = torch.full((length, length), discount, dtype=like.dtype, device=like.device) ** offsets.clamp(min=0)
    return torch.where(offsets >= 0, powers, torch.zeros_like(powers))


def discounted_reverse_cumsum(x: torch.Tensor, discount: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., j] = sum_{k >= j} discount^(k - j) x[..., k] along the last axis, without a loop over
    positions: one matmul with ``discount_matrix`` (stable for any length, unlike dividing by
    discount^k). Pass ``weights`` to reuse a matrix across calls."""
    if weights is None:
        weights = discount_matrix(x.shape[-1], discount, x)
    return x @ weights
