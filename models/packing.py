"""(prompt, action) token rows packed for one forward pass: padded rows with masks and positions from
true lengths, rows that share prompts, and the cut of rows into the passes that cost least.

Shapes: ``B`` rows, ``T`` packed tokens per row, ``U`` distinct prompts of ``P`` tokens, ``L`` action
tokens (the longest action in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

TokenBatch = Sequence[Sequence[int]] | tuple[torch.Tensor, torch.Tensor]
"""Token ids of B sequences: lists of ids, or a right-padded ``[B, N]`` tensor with its ``[B]`` true lengths."""


@dataclass
class PackedBatch:
    """(prompt, action) pairs packed into one padded ``[B, T]`` batch for a single forward pass."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens (from true lengths)
    position_ids: torch.Tensor  # [B, T] 0.. from each row's first real token (left padding shifts it)
    read_positions: torch.Tensor  # [B, L] column whose hidden state predicts action token k (prompt_len-1+k)
    action_ids: torch.Tensor  # [B, L]
    action_mask: torch.Tensor  # [B, L] True on real action tokens


@dataclass
class SharedPromptBatch:
    """(prompt, action) pairs whose prompts repeat (GRPO's groups): each distinct prompt is run once and
    its KV states are read by every row that continues it. ``U`` distinct prompts of up to ``P`` tokens."""

    prompt_ids: torch.Tensor  # [U, P] left-padded, so every prompt's last token sits in column P - 1
    prompt_mask: torch.Tensor  # [U, P] 1 on real tokens
    prompt_of_row: torch.Tensor  # [B] which distinct prompt row b continues
    action_ids: torch.Tensor  # [B, L] right-padded
    action_mask: torch.Tensor  # [B, L] True on real action tokens


def take(batch: TokenBatch, rows: list[int]) -> TokenBatch:
    """Rows ``rows`` of a TokenBatch (lists of ids, or padded ids with their lengths)."""
    if isinstance(batch, tuple):
        index = torch.as_tensor(rows, device=batch[0].device)
        return batch[0][index], batch[1][index]
    return [batch[row] for row in rows]


def token_lengths(ids: TokenBatch) -> list[int]:
    """The ``[B]`` true lengths of a TokenBatch."""
    return ids[1].tolist() if isinstance(ids, tuple) else [len(row) for row in ids]


def right_padded(ids: TokenBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, max(N, 1)] right-padded ids, [B] lengths)``; width >= 1 so gathers on empty actions stay valid."""
    if isinstance(ids, tuple):
        padded, lengths = ids[0].to(device=device, dtype=torch.long), ids[1].to(device=device, dtype=torch.long)
        if padded.dim() != 2 or lengths.shape != padded.shape[:1] or bool((lengths > padded.shape[1]).any()):
            raise ValueError(f"expected a [B, N] id tensor with [B] lengths <= N, got {tuple(padded.shape)} "
                             f"and {tuple(lengths.shape)}")
    else:
        rows = [torch.as_tensor(list(row), dtype=torch.long) for row in ids]
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.long, device=device)
        padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)
    if padded.shape[1] == 0:
        padded = padded.new_zeros(padded.shape[0], 1)
    return padded, lengths


def distinct_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """``(distinct prompts in first-seen order, [B] index of each row's prompt among them)``."""
    first_seen: dict[tuple[int, ...], int] = {}
    index = [first_seen.setdefault(tuple(row), len(first_seen)) for row in rows]
    return [list(key) for key in first_seen], index


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, P] ids, [B, P] attention mask)`` with each row right-aligned; the mask comes from lengths."""
    lengths = torch.tensor([len(row) for row in rows], device=device)
    width = int(lengths.max())
    is_real = torch.arange(width, device=device)[None] >= (width - lengths)[:, None]
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    input_ids[is_real] = torch.tensor([token for row in rows for token in row], dtype=torch.long, device=device)
    return input_ids, is_real.long()


def token_rows(ids: TokenBatch) -> list[list[int]]:
    """A TokenBatch as B lists of ids."""
    if isinstance(ids, tuple):
        return [row[:length].tolist() for row, length in zip(ids[0], ids[1].tolist())]
    return [list(row) for row in ids]


def pack_shared(prompts: TokenBatch, actions: TokenBatch, pad_id: int, device: torch.device,
                ) -> SharedPromptBatch | None:
    """The rows as a ``SharedPromptBatch`` when some prompts repeat, else None (nothing to share)."""
    distinct, prompt_of_row = distinct_rows(token_rows(prompts))
    if len(distinct) == len(prompt_of_row):
        return None
    if min(len(prompt) for prompt in distinct) < 1:
        raise ValueError("every prompt needs >= 1 token: an action's first log-prob is read at the last prompt token")
    prompt_ids, prompt_mask = left_padded(distinct, pad_id, device)
    action_ids, action_len = right_padded(actions, device)
    if len(action_len) != len(prompt_of_row):
        raise ValueError(f"{len(prompt_of_row)} prompts but {len(action_len)} actions: pass one action per prompt")
    return SharedPromptBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                             prompt_of_row=torch.tensor(prompt_of_row, device=device), action_ids=action_ids,
                             action_mask=torch.arange(action_ids.shape[1], device=device)[None] < action_len[:, None])


def pack(prompts: TokenBatch, actions: TokenBatch, pad_id: int, device: torch.device,
         padding_side: str = "right") -> PackedBatch:
    """Packs each prompt followed by its action into one row, padded on ``padding_side``.

    Masks and positions come from the true lengths only, so a pad id that is also a real token is harmless.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side={padding_side!r} must be 'left' or 'right'")
    prompt_ids, prompt_len = right_padded(prompts, device)
    action_ids, action_len = right_padded(actions, device)
    if prompt_len.shape != action_len.shape:
        raise ValueError(f"{len(prompt_len)} prompts but {len(action_len)} actions: pass one action per prompt")
    if bool((prompt_len < 1).any()):
        raise ValueError("every prompt needs >= 1 token: an action's first log-prob is read at the last prompt token")
    total_len = prompt_len + action_len  # [B]
    width = int(total_len.max())
    offset = width - total_len if padding_side == "left" else torch.zeros_like(total_len)  # [B] pad columns in front
    within = torch.arange(width, device=device)[None] - offset[:, None]  # [B, T] index inside the row's own sequence
    in_prompt = (within >= 0) & (within < prompt_len[:, None])
    in_action = (within >= prompt_len[:, None]) & (within < total_len[:, None])
    prompt_tokens = prompt_ids.gather(1, within.clamp(0, prompt_ids.shape[1] - 1))
    action_tokens = action_ids.gather(1, (within - prompt_len[:, None]).clamp(0, action_ids.shape[1] - 1))
    input_ids = torch.where(in_prompt, prompt_tokens, torch.where(in_action, action_tokens, pad_id))
    attention_mask = in_prompt | in_action
    steps = torch.arange(action_ids.shape[1], device=device)[None]  # [1, L]
    read_positions = (offset + prompt_len - 1)[:, None] + steps
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=torch.where(attention_mask, within, 0),
        read_positions=read_positions.clamp(max=width - 1),
        action_ids=action_ids,
        action_mask=steps < action_len[:, None],
    )


# The cost model of one forward + backward pass over packed rows, in units of one row's token (~0.1 ms on a
# CPU core with the tiny policy, 1 thread): a token also costs 1 / PASS_ATTENDED_TOKENS per position it
# attends to, and a pass costs PASS_COST more whatever its rows (layer kernels, autograd bookkeeping).
PASS_COST = 200
PASS_ATTENDED_TOKENS = 800


def cheapest_runs(count: int, run_costs: Callable[[int], np.ndarray]) -> list[tuple[int, int]]:
    """``(begin, end)`` of the consecutive runs that cut ``count`` sorted items at the least total cost, by
    dynamic programming over where the last run begins: ``run_costs(end)`` gives ``[end]`` costs of a last run
    ``[begin, end)`` for every begin (inf where such a run is not allowed)."""
    best = np.zeros(count + 1)  # best[end]: least cost of the first `end` items
    start = np.zeros(count + 1, dtype=np.int64)  # start[end]: where that best last run begins
    for end in range(1, count + 1):
        costs = best[:end] + run_costs(end)
        start[end] = costs.argmin()
        best[end] = costs[start[end]]
    cuts = [count]
    while cuts[-1] > 0:
        cuts.append(int(start[cuts[-1]]))
    cuts.reverse()
    return list(zip(cuts, cuts[1:]))


def length_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices grouped into the forward passes that cost least: rows sorted by packed length (stably)
    and cut into consecutive runs, each padded to its longest row, at the least modelled cost (above).
    Rows of MATH-like spread (15-1,500 tokens) split into a few passes instead of padding every row to
    the longest; rows of one length stay one pass in the given order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    widths = np.array([lengths[i] for i in order], dtype=np.float64)

    def run_costs(end: int) -> np.ndarray:
        rows, width = end - np.arange(end), widths[end - 1]
        return PASS_COST + rows * width * (1 + width / PASS_ATTENDED_TOKENS)

    runs = cheapest_runs(len(order), run_costs)
    if len(runs) <= 1:
        return [list(range(len(order)))]
    return [order[begin:end] for begin, end in runs]
