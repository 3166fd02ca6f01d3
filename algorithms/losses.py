"""The shared math of every algorithm: masked reductions and loss aggregation, the importance ratio
(per token or per sequence), the one clipped surrogate (asymmetric and dual clipping), the value loss,
KL estimators and discounted sums. Pure functions on tensors; no models, no I/O."""

from __future__ import annotations

from typing import NamedTuple

import torch

from envs.modes import ImportanceSamplingLevel, KLEstimator, LossAgg


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 where nothing is unmasked)."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: LossAgg, scale_factor: int | None = None) -> torch.Tensor:
    """Reduces a per-token loss [B, L] to a scalar (verl's ``loss_agg_mode``; l_it the loss of token t of action
    i, |y_i| its length, M = ``scale_factor``).

    token-mean: sum_it l_it / sum_i |y_i|: every token weighs the same (DAPO, Yu et al. 2025).
    seq-mean-token-mean: mean_i (sum_t l_it / |y_i|): every action weighs the same (GRPO, Shao et al. 2024).
    seq-mean-token-sum: mean_i sum_t l_it.
    seq-mean-token-sum-norm: mean_i sum_t l_it / M with M fixed for the run, the longest possible action: no
        length-dependent weighting at all (Dr. GRPO, Liu et al. 2025; TRL's ``loss_type="dr_grpo"``, verl's mode
        with ``loss_scale_factor``).
    """
    mode = LossAgg(mode)
    if mode is LossAgg.TOKEN_MEAN:
        return masked_mean(loss, mask)
    if mode is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return masked_mean(loss, mask, dim=-1).mean()
    sums = masked_sum(loss, mask, dim=-1).mean()
    if mode is LossAgg.SEQ_MEAN_TOKEN_SUM:
        return sums
    if scale_factor is None or scale_factor < 1:
        raise ValueError(f"loss aggregation {mode} divides by a fixed length: give scale_factor >= 1 (the longest "
                         f"action, e.g. max_new_tokens), not {scale_factor!r}")
    return sums / scale_factor


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


def importance_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor,
                         level: ImportanceSamplingLevel = ImportanceSamplingLevel.TOKEN) -> torch.Tensor:
    """log of the importance ratio against the rollout log-probs, [B, L] (inputs [B, L]).

    token: log pi(y_t) - log pi_old(y_t) (PPO).
    sequence: log s_i = (1/|y_i|) sum_t (log pi(y_t) - log pi_old(y_t)) on every token of action i, its gradient
        that of log pi(y_t) (GSPO-token, Zheng et al. 2025: s_it = sg[s_i] pi(y_t) / sg[pi(y_t)]); with
        one advantage per action its gradient is GSPO's, and clipping keeps or drops a whole action.
    """
    log_ratio = log_probs - old_log_probs
    if ImportanceSamplingLevel(level) is ImportanceSamplingLevel.TOKEN:
        return log_ratio
    sequence = masked_mean(log_ratio, mask, dim=-1).detach()[:, None]
    return log_probs - log_probs.detach() + sequence


class Surrogate(NamedTuple):
    """The clipped policy loss and where each bound acted, all of one shape, the masks as 0/1 floats."""

    loss: torch.Tensor
    clipped_low: torch.Tensor  # A < 0 and ratio < 1 - eps_low: the lower clip held the loss
    clipped_high: torch.Tensor  # A > 0 and ratio > 1 + eps_high: the upper clip held the loss
    dual_clipped: torch.Tensor  # A < 0 and the loss held at clip_ratio_c * |A| (dual clip)


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float | None = None, clip_ratio_c: float | None = None) -> Surrogate:
    """PPO's clipped policy loss, elementwise, with r = exp(log_ratio):

        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)           (Schulman et al. 2017)
        eps_high > eps_low: clip-higher, room for unlikely tokens to grow (DAPO, Yu et al. 2025)
        where A < 0: loss = min(loss, -c A), a bound on how far a ratio far above 1 can push
        (dual-clip PPO, Ye et al. 2020; c = ``clip_ratio_c`` > 1, None: off)

    Inputs broadcast to one shape ([B] per action, [B, L] per token); ``clip_high`` None: ``clip_low``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    held = clipped < unclipped
    dual_clipped = torch.zeros_like(held)
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * advantages
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    as_float = loss.dtype
    return Surrogate(loss, (held & (advantages < 0)).to(as_float), (held & (advantages > 0)).to(as_float),
                     dual_clipped.to(as_float))


def huber(error: torch.Tensor, delta: float) -> torch.Tensor:
    """0.5 e^2 for |e| <= delta, delta (|e| - delta/2) beyond: quadratic near 0, linear in |e| far
    out, on both sides of zero (the absolute value matters for negative errors)."""
    abs_error = error.abs()
    return torch.where(abs_error <= delta, 0.5 * error**2, delta * (abs_error - 0.5 * delta))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip_param: float,
    huber_delta: float = 0.0,
) -> torch.Tensor:
    """Elementwise critic loss: max(f(R - V), f(R - V_clipped)) with V_clipped kept within
    ``clip_param`` of the values at collection time (no clipping if 0); f is the Huber loss with
    ``huber_delta`` (0: 0.5 * squared error)."""
    def f(error: torch.Tensor) -> torch.Tensor:
        return huber(error, huber_delta) if huber_delta else 0.5 * error**2

    loss = f(returns - values)
    if not clip_param:
        return loss
    clipped_values = old_values + (values - old_values).clamp(-clip_param, clip_param)
    return torch.maximum(loss, f(returns - clipped_values))


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per sample: exp(d) - d - 1 with d = log ref - log pi.
    Unbiased, always >= 0, low variance; GRPO's KL penalty."""
    log_ratio = ref_log_probs - log_probs
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """KL(pi || ref) estimated per sample y ~ pi, elementwise (Schulman 2020, "Approximating KL divergence"),
    with d = log ref(y) - log pi(y):

    k1 = -d (unbiased, high variance, often negative); k2 = d^2 / 2 (biased, low variance);
    k3 = exp(d) - 1 - d (unbiased, low variance, >= 0); low_var_kl: k3 with d clamped to [-20, 20] and the
    estimate to [-10, 10] (verl's form, bounded where pi and ref disagree sharply).
    """
    estimator = KLEstimator(estimator)
    if estimator is KLEstimator.K1:
        return log_probs - ref_log_probs
    if estimator is KLEstimator.K2:
        return 0.5 * (ref_log_probs - log_probs) ** 2
    if estimator is KLEstimator.K3:
        return kl_k3(log_probs, ref_log_probs)
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


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
