"""Statistics of an update that steer or describe it: the target-KL early stop and each role's means
(multi-agent envs: entropy, approx KL to the behaviour policy and, with a critic, value loss per role)."""

from __future__ import annotations

from typing import Sequence

import torch

from algorithms.buffer import Batch
from algorithms.losses import kl_k3, masked_mean


def kl_early_stop(approx_kl: float, target_kl: float) -> bool:
    """Whether a minibatch's approx KL to the behaviour policy ends the update's epochs (``target_kl`` 0: never)."""
    return bool(target_kl) and approx_kl > target_kl


def row_statistics(log_probs: torch.Tensor, entropy: torch.Tensor, batch: Batch,
                   value_loss: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """[B] per action of ``batch``: its mean token entropy, its approx KL (k3, joint log-prob) to the
    behaviour policy and, given (``value_loss`` [B]), its value loss. ``log_probs``, ``entropy``: [B, L]."""
    mask = batch.token_mask.to(log_probs.dtype)
    rows = {"entropy": masked_mean(entropy, mask, dim=-1),
            "approx_kl": kl_k3(batch.old_log_probs.sum(-1), log_probs.sum(-1))}
    if value_loss is not None:
        rows["value_loss"] = value_loss
    return {name: values.detach() for name, values in rows.items()}


def role_sums(rows: dict[str, torch.Tensor], agents: torch.Tensor,
              roles: Sequence[str]) -> dict[str, tuple[float, int]]:
    """``<role>/<name>`` -> (sum, count) of each role's rows of ``rows`` ([B] each; ``agents`` [B] the agent
    slot of each row); roles without a row in the batch are left out."""
    sums = {}
    for a, role in enumerate(roles):
        mine = agents == a
        if mine.any():
            for name, values in rows.items():
                sums[f"{role}/{name}"] = (float(values[mine].sum()), int(mine.sum()))
    return sums
