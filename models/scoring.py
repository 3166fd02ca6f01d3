"""Memory-lean token scoring: log-probs and entropies of chosen tokens from final hidden states.

The vocabulary projection runs on row chunks of at most ``CHUNK_ELEMENTS`` logits, so neither the
forward nor the backward ever holds a ``[N, V]`` float32 tensor for all ``N`` scored tokens (at
V = 151,936 one such tensor over 8 x 1,024 tokens is 5 GB). With a bias-free ``nn.Linear`` head (every
causal LM the project loads, LoRA included: peft leaves the output layer alone) the backward is written
out (``LinearTokenScores``): it reads the log-probs its forward kept (past ``KEPT_LOG_PROBS_ELEMENTS``
it recomputes a chunk's logits, one matmul) and takes the gradient of the log-softmax and the entropy from
their closed forms, instead of replaying the chunk's forward and differentiating its elementwise ops over
``[n, V]``. Any other head runs each chunk under activation checkpointing and autograd. Both give the
plain computation's values and gradients.

Shapes: ``B`` rows, ``L`` action tokens, ``H`` hidden size, ``V`` vocabulary, ``N`` real tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Autocast = Callable[[], contextlib.AbstractContextManager]
CHUNK_ELEMENTS = 2 ** 24  # logits per chunk: a [rows, V] float32 chunk takes 64 MB
KEPT_LOG_PROBS_ELEMENTS = 2 ** 26
"""Most log-probs (256 MB of float32) a forward with a Linear head keeps for its backward, which then needs
no matmul to recompute them; a batch of more scores recomputes them chunk by chunk."""


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


class LinearTokenScores(torch.autograd.Function):
    """Chosen-token log-probs and entropies of ``softmax(rows @ weight.T / temperature)`` in row chunks, with
    the backward in closed form. With ``z`` the scaled logits, ``log p = z - logsumexp(z)`` and ``H`` the
    entropy: d log p_t / dz = onehot(t) - p and dH / dz = -p * (log p + H). The forward keeps the rows, each
    row's logsumexp and, with ``keep``, the log-probs; without, the backward recomputes a chunk's logits (one
    matmul). Shapes: ``rows`` [N, H], ``weight`` [V, H], ``targets`` [N]; returns the
    chosen log-probs [N] and the entropies [N] (empty without ``with_entropy``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                rows_per_chunk: int, with_entropy: bool, autocast: Autocast,
                keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, log_normalizers, entropies, kept = [], [], [], []
        for part, part_targets in zip(rows.split(rows_per_chunk), targets.split(rows_per_chunk)):
            logits, ctx.matmul_dtype = scaled_logits(part, weight, temperature, autocast)  # [n, V] float32
            log_probs = logits.log_softmax(-1)
            chosen.append(log_probs.gather(-1, part_targets[:, None]).squeeze(-1))  # [n]
            log_normalizers.append(logits.gather(-1, part_targets[:, None]).squeeze(-1) - chosen[-1])
            if with_entropy:
                entropies.append(-log_probs.exp().mul_(log_probs).sum(-1))
            if keep:
                kept.append(log_probs)
        log_normalizer = torch.cat(log_normalizers)
        entropy = torch.cat(entropies) if with_entropy else log_normalizer.new_zeros(0)
        ctx.save_for_backward(rows, weight, targets, log_normalizer, entropy)
        ctx.settings = (temperature, rows_per_chunk, with_entropy, autocast)
        ctx.kept_log_probs = kept if keep else None
        return torch.cat(chosen), entropy

    @staticmethod
    def backward(ctx, grad_chosen: torch.Tensor, grad_entropy: torch.Tensor):
        rows, weight, targets, log_normalizer, entropy = ctx.saved_tensors
        temperature, rows_per_chunk, with_entropy, autocast = ctx.settings
        entropy_grad = with_entropy and bool(grad_entropy.any())  # 0 x entropy (no bonus): no gradient to add
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_weight = None  # [V, H] float32, summed over the chunks
        for index, start in enumerate(range(0, len(rows), rows_per_chunk)):
            part = slice(start, start + rows_per_chunk)
            if ctx.kept_log_probs is None:
                logits = scaled_logits(rows[part], weight, temperature, autocast)[0]
                log_probs = logits.sub_(log_normalizer[part, None])  # [n, V]
            else:
                log_probs = ctx.kept_log_probs[index]
            probs = log_probs.exp()
            if entropy_grad:  # -p * (g_c + g_H * (log p + H)), then + g_c at the chosen token
                weights = (log_probs + entropy[part, None]).mul_(grad_entropy[part, None])
                grad_logits = probs.mul_(weights.add_(grad_chosen[part, None])).neg_()
            else:
                grad_logits = probs.mul_(-grad_chosen[part, None])
            grad_logits[torch.arange(len(log_probs)), targets[part]] += grad_chosen[part]
            grad_logits = grad_logits.div_(temperature).to(ctx.matmul_dtype)  # as autograd: the forward's dtype
            if grad_rows is not None:
                grad_rows[part] = grad_logits.mm(weight.to(ctx.matmul_dtype)).to(rows.dtype)
            if ctx.needs_input_grad[1]:
                part_grad = grad_logits.T.mm(rows[part].to(ctx.matmul_dtype)).float()
                grad_weight = part_grad if grad_weight is None else grad_weight.add_(part_grad)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_rows, grad_weight, None, None, None, None, None, None


def scaled_logits(rows: torch.Tensor, weight: torch.Tensor, temperature: float,
                  autocast: Autocast) -> tuple[torch.Tensor, torch.dtype]:
    """(``[n, V]`` float32 ``rows @ weight.T / temperature``, the dtype its matmul ran in under ``autocast``)."""
    with autocast():
        logits = torch.nn.functional.linear(rows, weight)
    return logits.float().div_(temperature), logits.dtype


def token_scores(lm_head: nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor, mask: torch.Tensor,
                 temperature: float, with_entropy: bool, autocast: Autocast = contextlib.nullcontext,
                 rows_per_chunk: int | None = None) -> ActionScores:
    """Log-probs of ``token_ids`` [B, L] (and entropies) under ``lm_head(hidden) / temperature`` from
    ``hidden`` [B, L, H], computed on the ``mask`` [B, L] positions only, ``rows_per_chunk`` of them at a
    time (default ``chunk_rows(V)``). ``autocast``: the context the projection runs in (its matmul dtype);
    the softmax runs in float32. Logits are ``lm_head(hidden)``: models whose causal-LM forward
    post-processes logits (e.g. Gemma-2 softcapping) are not handled."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (score greedy samples at temperature 1.0)")
    rows, targets = hidden[mask], token_ids[mask]  # [N, H], [N]
    size = rows_per_chunk or chunk_rows(lm_head.weight.shape[0])
    if isinstance(lm_head, nn.Linear) and lm_head.bias is None:
        # kept for a backward that will come; past the bound the backward recomputes them
        keep = torch.is_grad_enabled() and len(rows) * lm_head.weight.shape[0] <= KEPT_LOG_PROBS_ELEMENTS
        chosen, entropy = LinearTokenScores.apply(rows, lm_head.weight, targets, temperature, size, with_entropy,
                                                  autocast, keep)
        parts = (chosen, entropy) if with_entropy else (chosen,)
    else:
        parts = checkpointed_scores(lm_head, rows, targets, temperature, size, with_entropy, autocast)
    scattered = [scatter_rows(part, mask) for part in parts]
    return ActionScores(log_probs=scattered[0], mask=mask, entropy=scattered[1] if with_entropy else None)


def checkpointed_scores(lm_head: nn.Module, rows: torch.Tensor, targets: torch.Tensor, temperature: float,
                        rows_per_chunk: int, with_entropy: bool, autocast: Autocast) -> tuple[torch.Tensor, ...]:
    """(``[N]`` chosen log-probs, ``[N]`` entropies if ``with_entropy``) for any head, each chunk under
    activation checkpointing when a gradient will flow, so its ``[n, V]`` tensors are not kept."""

    def score(part: torch.Tensor, part_targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with autocast():
            logits = lm_head(part)  # [n, V]
        log_probs = (logits.float() / temperature).log_softmax(-1)
        chosen = log_probs.gather(-1, part_targets[:, None]).squeeze(-1)
        return (chosen, -(log_probs.exp() * log_probs).sum(-1)) if with_entropy else (chosen,)

    recompute = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    chunks = [checkpoint(score, part, part_targets, use_reentrant=False) if recompute else score(part, part_targets)
              for part, part_targets in zip(rows.split(rows_per_chunk), targets.split(rows_per_chunk))]
    return tuple(torch.cat(parts) for parts in zip(*chunks))


def scatter_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` with ``values`` [N] at the ``mask`` positions (row-major) and 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)
