"""The Algorithm protocol, its settings, and the registry the runner picks algorithms from.

An algorithm is pure tensor math: ``compute_advantages`` reads a filled ``RolloutBuffer`` and writes
its ``advantages`` (and ``returns``); ``loss`` turns the policy's scores of one micro-batch into a
scalar. The runner owns models, generation and optimisation. Adding an algorithm is a file with a
class following ``Algorithm`` plus one line in ``ALGORITHMS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from algorithms.losses import aggregate, clipped_surrogate, kl_k3, masked_mean

if TYPE_CHECKING:
    from algorithms.buffer import Batch, RolloutBuffer
    from train.models.policy import ActionScores

ALGORITHMS = {
    "APPO": "algorithms.appo:APPO",
    "GRPO": "algorithms.grpo:GRPO",
    "TPPO": "algorithms.tppo:TPPO",
    "RLOO": "algorithms.rloo:RLOO",
}
"""Name -> "module:Class"; modules are imported on first use."""

CRITICS = (None, "action", "token")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Hyper-parameters shared by the algorithms (each reads the ones it needs)."""

    clip_param: float = 0.2
    value_clip_param: float | None = 0.2  # None: no value clipping
    huber_delta: float | None = None  # None: 0.5 * squared error
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    gamma: float = 1.0
    gae_lambda: float = 0.95
    scale_rewards: str = "group"
    kl_coef: float = 0.0
    loss_agg: str = "token_mean"
    process_coef: float = 1.0  # RLOO: weight of the implicit-PRM stream
    accuracy_lower_bound: float = 0.2  # RLOO: PRIME's prompt filter
    accuracy_upper_bound: float = 0.8
    max_groups: int | None = None  # RLOO: groups kept after filtering an oversampled batch


class Algorithm(Protocol):
    """What the runner needs from an algorithm.

    ``episodic``: collect exactly one episode per env per iteration (GRPO, RLOO compare whole
    episodes within a group) instead of ``episode_length`` steps of continuing episodes (APPO, TPPO).
    ``critic``: None, "action" (V(s) per step) or "token" (V per action token).
    ``needs_reference``: the loss reads ``batch.ref_logprobs`` (KL to the reference policy).
    ``needs_process_rewards``: ``compute_advantages`` reads ``buffer.token_rewards`` (implicit PRM).
    """

    name: str
    episodic: bool
    critic: str | None
    needs_reference: bool
    needs_process_rewards: bool

    def compute_advantages(self, buffer: RolloutBuffer) -> dict[str, torch.Tensor]:
        """Fills ``buffer.advantages`` ([T, N, A] or [T, N, A, L]) and ``buffer.returns``; returns
        tensors worth logging (e.g. episode returns)."""
        ...

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the minibatch loss (already multiplied by ``batch.weight``, so
        summing over micro-batches gives the minibatch loss) and detached micro-batch statistics."""
        ...

    def skippable_rows(self, batch: Batch) -> torch.Tensor:
        """[B] rows whose loss and gradient are exactly zero (the runner need not forward them)."""
        ...


def algorithm_class(name: str) -> type:
    """The class registered as ``name`` (e.g. "GRPO")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    module_name, _, class_name = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_algorithm(name: str, config: AlgorithmConfig) -> Algorithm:
    return algorithm_class(name)(config)


def token_policy_loss(scores: ActionScores, batch: Batch, advantages: torch.Tensor, config: AlgorithmConfig,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate (+ k3 KL to the reference, - entropy bonus), aggregated by
    ``config.loss_agg``; shared by GRPO, TPPO and RLOO. ``advantages``: [B, L] or [B, 1]."""
    mask = batch.token_mask.to(scores.logprobs.dtype)
    surrogate, clipped = clipped_surrogate(scores.logprobs, batch.old_logprobs, advantages, config.clip_param)
    per_token = surrogate
    stats = {"clip_fraction": masked_mean(clipped, mask), "approx_kl": masked_mean(kl_k3(batch.old_logprobs, scores.logprobs), mask)}
    if config.kl_coef > 0:
        kl = kl_k3(scores.logprobs, batch.ref_logprobs)
        per_token = per_token + config.kl_coef * kl
        stats["kl_ref"] = masked_mean(kl, mask)
    if scores.entropy is not None:
        stats["entropy"] = masked_mean(scores.entropy, mask)
        per_token = per_token - config.entropy_coef * scores.entropy
    stats["policy_loss"] = aggregate(surrogate, mask, config.loss_agg)
    weight = batch.weight(config.loss_agg)
    return aggregate(per_token, mask, config.loss_agg) * weight, detached(stats)


def detached(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in stats.items()}


def zero_advantage_rows(advantages: torch.Tensor, config: AlgorithmConfig) -> torch.Tensor:
    """[B] rows with all-zero advantages, whose loss is exactly zero when no KL or entropy term
    applies (e.g. groups that were all right or all wrong): skipping them saves their forward pass."""
    if config.kl_coef > 0 or config.entropy_coef > 0:
        return torch.zeros(advantages.shape[0], dtype=torch.bool, device=advantages.device)
    return (advantages == 0).reshape(advantages.shape[0], -1).all(-1)
