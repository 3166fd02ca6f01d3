"""The Algorithm protocol, its settings, and the policy-loss pieces GRPO, TPPO and RLOO share.

An algorithm is pure tensor math: ``advantages`` reads a filled ``RolloutBuffer`` and returns its
``AdvantageEstimate`` (advantages, returns, which slots to train on) without changing the buffer; ``loss``
turns the policy's scores of one micro-batch into a scalar. What it reads from a policy is named by
the ``ActionScores`` protocol; the trainer owns models, generation and optimisation. Algorithms are
registered, with the traits the trainer needs, in ``algorithms.registry``; their settings are
``algorithms.config.AlgorithmConfig``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Protocol

import numpy as np
import torch

from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.losses import (Surrogate, aggregate, clipped_surrogate, importance_log_ratio, kl_estimate, kl_k3,
                               masked_mean)
from algorithms.config import AlgorithmConfig, kl_in_reward
from algorithms.registry import algorithm_spec
from algorithms.rollout_correction import rollout_weighted


class ActionScores(Protocol):
    """What a loss reads from the policy's forward pass over one micro-batch of B actions of L tokens.

    log_probs: [B, L] log-probs of the action tokens. entropy: [B, L] or None. values: [B, L] the
    critic's V(prompt, a_<k) (so ``values[:, 0]`` is V(s_t)), or None without a critic.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None


def decoupled_gae(estimate: Callable[[float], tuple[torch.Tensor, torch.Tensor]], config: AlgorithmConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages at ``config.gae_lambda``, returns at ``config.value_lambda``) from ``estimate(lam)``,
    which gives (advantages, returns) at one lambda (Decoupled GAE, VAPO arXiv 2504.05118).

    Why two lambdas: returns at lambda < 1 are mostly the critic's own later values (a token j steps
    before the reward sees it with weight lambda^j), so a biased critic regresses onto its bias and can
    drift away from the rewards; lambda = 1 anchors every target on the rewards. The policy keeps a
    lower lambda for lower-variance advantages."""
    advantages, returns = estimate(config.gae_lambda)
    if config.value_lambda != config.gae_lambda:
        returns = estimate(config.value_lambda)[1]
    return advantages, returns


class Algorithm(Protocol):
    """What the runner needs from an algorithm (its episodic/critic traits are in ``algorithms.registry``).

    ``needs_reference``: the loss reads ``batch.ref_log_probs`` (KL to the reference policy).
    ``needs_process_rewards``: ``advantages`` reads ``buffer.token_rewards`` (implicit PRM) of the slots
    ``kept`` returns.
    """

    name: str
    needs_reference: bool
    needs_process_rewards: bool

    def kept(self, buffer: RolloutBuffer) -> torch.Tensor:
        """[T, N, A] the live slots ``advantages`` will train on (before any rollout correction)."""
        ...

    def advantages(self, buffer: RolloutBuffer) -> AdvantageEstimate:
        """The buffer's training targets: advantages ([T, N, A] or [T, N, A, L]), returns (critics),
        the slots to train on, and tensors worth logging. Never changes the buffer."""
        ...

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the minibatch loss (already multiplied by ``batch.weight``, so
        summing over micro-batches gives the minibatch loss) and detached micro-batch statistics."""
        ...

    def skippable_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        """[B] rows whose loss and gradient are exactly zero, from their ``advantages`` [B] or [B, L] (the runner
        need not forward them)."""
        ...

    def value_loss_rows(self, scores: ActionScores, batch: Batch) -> torch.Tensor | None:
        """[B] each action's value loss (the one ``loss`` trains the critic on), or None without a critic."""
        ...


SumReducer = Callable[[torch.Tensor], torch.Tensor]
"""Adds a tensor over the processes that each hold part of one batch (the identity in one process)."""


def batch_mean_std(values: torch.Tensor, reduce_sum: SumReducer) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of ``values`` [K] over the whole batch, of which ``values`` may be one
    process's part (two passes, as ``Tensor.std``; std 1 for fewer than two values)."""
    count, total = reduce_sum(torch.stack([values.new_tensor(values.numel()), values.sum()]))
    mean = total / count.clamp(min=1)
    squares = reduce_sum(((values - mean) ** 2).sum())
    std = (squares / (count - 1)).sqrt() if bool(count > 1) else values.new_tensor(1.0)
    return mean, std


def roc_auc(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` [K] for ``labels`` [K] in {0, 1}: P(score of a random
    positive > that of a random negative), ties counted half."""
    scores, labels = torch.as_tensor(scores), torch.as_tensor(labels)
    positives, negatives = scores[labels == 1], scores[labels == 0]
    if len(positives) == 0 or len(negatives) == 0:
        raise ValueError(f"ROC-AUC needs both classes, got {len(positives)} positives and {len(negatives)} negatives")
    greater = (positives[:, None] > negatives[None]).sum() + 0.5 * (positives[:, None] == negatives[None]).sum()
    return float(greater / (len(positives) * len(negatives)))


class BaseAlgorithm:
    """What the algorithms share: their settings, a reference pass only when the loss has a KL term, and
    ``reduce_sum`` for statistics over the whole batch (set by the trainer under data parallelism)."""

    needs_process_rewards = False

    def __init__(self, config: AlgorithmConfig):
        self.config = config
        self.reduce_sum: SumReducer = lambda tensor: tensor

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0  # in the loss or in the reward

    def value_loss_rows(self, scores: ActionScores, batch: Batch) -> torch.Tensor | None:
        return None

    def kept(self, buffer: RolloutBuffer) -> torch.Tensor:
        return buffer.live


def reward_kl(buffer: RolloutBuffer, config: AlgorithmConfig) -> torch.Tensor | None:
    """[T, N, A, L] the per-token KL estimate that, times ``kl_coef``, each action token pays as a reward
    penalty (r_t <- r_t - beta KL_t, as in InstructGPT and REINFORCE++; verl's ``use_kl_in_reward``): the
    ``kl_penalty`` estimate of KL(pi_old || ref) from the rollout log-probs, 0 on padding. None when the KL
    is not in the reward."""
    if not (config.use_kl_in_reward and config.kl_coef > 0):
        return None
    return kl_estimate(buffer.rollout_log_probs, buffer.ref_log_probs, config.kl_penalty) * buffer.token_mask()


def make_algorithm(name: str, config: AlgorithmConfig) -> Algorithm:
    """An instance of the class registered as ``name`` (e.g. "GRPO"), ``use_kl_in_reward`` left None resolved to
    its default."""
    module_name, _, class_name = algorithm_spec(name).target.partition(":")
    config = dataclasses.replace(config, use_kl_in_reward=kl_in_reward(config.use_kl_in_reward, name))
    return getattr(importlib.import_module(module_name), class_name)(config)


def token_policy_loss(scores: ActionScores, batch: Batch, advantages: torch.Tensor, config: AlgorithmConfig,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate (+ ``kl_coef`` * the ``kl_loss_type`` KL to the reference unless the KL is
    in the reward, - entropy bonus), aggregated by ``config.loss_agg_mode``; shared by the critic-free
    algorithms and TPPO. ``advantages``: [B, L] or [B, 1]. The ratio is per token or per sequence
    (``importance_sampling_level``, GSPO)."""
    mask = batch.token_mask.to(scores.log_probs.dtype)
    log_ratio = importance_log_ratio(scores.log_probs, batch.old_log_probs, mask, config.importance_sampling_level)
    surrogate = clipped_surrogate(log_ratio, advantages, config.clip_low, config.clip_high, config.clip_ratio_c)
    per_token = rollout_weighted(surrogate.loss, batch)
    stats = {**clip_stats(surrogate, mask, config),
             "approx_kl": masked_mean(kl_k3(batch.old_log_probs, scores.log_probs), mask)}
    if config.kl_in_loss:
        kl = kl_estimate(scores.log_probs, batch.ref_log_probs, config.kl_loss_type)
        per_token = per_token + config.kl_coef * kl
        stats["kl_ref"] = masked_mean(kl, mask)
    if scores.entropy is not None:
        stats["entropy"] = masked_mean(scores.entropy, mask)
        per_token = per_token - config.entropy_coef * scores.entropy
    stats["policy_loss"] = aggregate(surrogate.loss, mask, config.loss_agg_mode, config.loss_scale_factor)
    return minibatch_share(per_token, mask, batch, config), detached(stats)


def minibatch_share(per_token: torch.Tensor, mask: torch.Tensor, batch: Batch, config: AlgorithmConfig) -> torch.Tensor:
    """The micro-batch's share of its minibatch's ``loss_agg_mode`` aggregate of ``per_token`` [B, L]: summed over
    the micro-batches it gives the minibatch's aggregate (tokens or actions weigh the same across micro-batches)."""
    weight = batch.weight(config.loss_agg_mode)
    return aggregate(per_token, mask, config.loss_agg_mode, config.loss_scale_factor) * weight


def clip_stats(surrogate: Surrogate, mask: torch.Tensor, config: AlgorithmConfig) -> dict[str, torch.Tensor]:
    """Shares of tokens (or of actions, with ``mask`` all ones) whose loss a clip held: either bound, the lower
    and the upper one apart (clip-higher moves the upper), and the dual clip when it is on."""
    stats = {"clip_fraction": masked_mean(surrogate.clipped_low + surrogate.clipped_high, mask),
             "clip_fraction_low": masked_mean(surrogate.clipped_low, mask),
             "clip_fraction_high": masked_mean(surrogate.clipped_high, mask)}
    if config.clip_ratio_c is not None:
        stats["dual_clip_fraction"] = masked_mean(surrogate.dual_clipped, mask)
    return stats


def detached(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in stats.items()}


def zero_advantage_rows(advantages: torch.Tensor, config: AlgorithmConfig) -> torch.Tensor:
    """[B] rows with all-zero advantages, whose loss is exactly zero when no KL or entropy term
    applies (e.g. groups that were all right or all wrong): skipping them saves their forward pass."""
    if config.kl_in_loss or config.entropy_coef > 0:
        return torch.zeros(advantages.shape[0], dtype=torch.bool, device=advantages.device)
    return (advantages == 0).reshape(advantages.shape[0], -1).all(-1)
