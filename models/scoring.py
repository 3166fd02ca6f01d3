"""Memory-lean token scoring: log-probs and entropies of chosen tokens from final hidden states.

The vocabulary projection runs on row chunks of at most ``CHUNK_ELEMENTS`` logits, each under
activation checkpointing, so neither the forward nor the backward ever holds a ``[N, V]`` float32
tensor for all ``N`` scored tokens (at V = 151,936 one such tensor over 8 x 1,024 tokens is 5 GB).
The backward recomputes a chunk's logits from its hidden rows: gradients are exact, and a batch
that fits one chunk runs exactly the plain computation.

Shapes: ``B`` rows, ``L`` action tokens, ``H`` hidden size, ``V`` vocabulary, ``N`` real tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 2 ** 24  # logits per chunk: a [rows, V] float32 chunk takes 64 MB


@dataclass
class ActionScores:
    """Per-token scores of actions; every tensor is 0 where ``mask`` is False."""

    log_probs: torch.Tensor  # [B, L] log pi(a_k | prompt, a_<k) under logits / temperature
    mask: torch.Tensor  # [B, L] bool
    entropy: torch.Tensor | None = None  # [B, L] entropy of that temperature-scaled distribution
    values: torch.Tensor | None = None  # [B, L] V(prompt, a_<k); values[:, 0] = V(prompt)

    @classmethod
    def interleave(cls, parts: Sequence[tuple[list[int], "ActionScores"]], size: int) -> "ActionScores":
        """``size`` rows from ``parts``: (the rows its scores take, scores of width L_i), padded to the widest."""

        def merged(name: str) -> torch.Tensor | None:
            if getattr(parts[0][1], name) is None:
                return None
            return interleave_rows([(rows, getattr(scores, name)) for rows, scores in parts], size)
        return cls(**{name: merged(name) for name in ("log_probs", "mask", "entropy", "values")})


def interleave_rows(parts: Sequence[tuple[list[int], torch.Tensor]], size: int) -> torch.Tensor:
    """``[size, L]``: each part's ``[B_i, L_i]`` tensor written at its rows, zeros (False) to the widest L."""
    width = max(tensor.shape[1] for _, tensor in parts)
    out = parts[0][1].new_zeros(size, width)
    for rows, tensor in parts:
        out[torch.as_tensor(rows, device=out.device), :tensor.shape[1]] = tensor
    return out


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: as many as keep a chunk's logits within ``CHUNK_ELEMENTS``."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def token_scores(lm_head: nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor, mask: torch.Tensor,
                 temperature: float, with_entropy: bool,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 rows_per_chunk: int | None = None) -> ActionScores:
    """Log-probs of ``token_ids`` [B, L] (and entropies) under ``lm_head(hidden) / temperature`` from
    ``hidden`` [B, L, H], computed on the ``mask`` [B, L] positions only, ``rows_per_chunk`` of them at a
    time (default ``chunk_rows(V)``). ``autocast``: the context the projection runs in (its matmul dtype);
    the softmax runs in float32. Logits are ``lm_head(hidden)``: models whose causal-LM forward
    post-processes logits (e.g. Gemma-2 softcapping) are not handled."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (score greedy samples at temperature 1.0)")

    def score(rows: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with autocast():
            logits = lm_head(rows)  # [n, V]
        log_probs = (logits.float() / temperature).log_softmax(-1)
        chosen = log_probs.gather(-1, targets[:, None]).squeeze(-1)
        return (chosen, -(log_probs.exp() * log_probs).sum(-1)) if with_entropy else (chosen,)

    rows, targets = hidden[mask], token_ids[mask]  # [N, H], [N]
    size = rows_per_chunk or chunk_rows(lm_head.weight.shape[0])
    recompute = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    chunks = [checkpoint(score, part, part_targets, use_reentrant=False) if recompute else score(part, part_targets)
              for part, part_targets in zip(rows.split(size), targets.split(size))]
    scattered = [scatter_rows(torch.cat(parts), mask) for parts in zip(*chunks)]
    return ActionScores(log_probs=scattered[0], mask=mask, entropy=scattered[1] if with_entropy else None)


def scatter_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` with ``values`` [N] at the ``mask`` positions (row-major) and 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)
