"""How the HF backend cuts a call into decoding batches: a cost model of prefill and decode steps, the
cheapest split of length-sorted rows within the row and cache caps, and when to drop ended rows."""

from __future__ import annotations

import numpy as np
import torch

from models.packing import cheapest_runs

# The cost model of decoding one batch, in units of one row attending to one cached position in one decode
# step (~0.28 us on a CPU core with the tiny policy). Measured there with 1 thread: a decode forward costs
# ~1.9 ms whatever its rows (layer kernels, the decode loop's own ops), and a prefilled token ~34 us plus
# ~0.043 us per position it attends to. A larger model on a CPU makes padding dearer relative to a step's
# fixed cost, so there these constants err towards fewer batches.
STEP_COST = 6_800
PREFILL_TOKEN_COST = 120
PREFILL_PAIR_COST = 0.15
UNMODELLED_BATCH_COST = 1e12
"""Cost of one more batch without the model: so large that the fewest batches within the caps win."""


def batch_costs(rows: np.ndarray, longest_prompt: int, max_new_tokens: int, by_cost: bool) -> np.ndarray:
    """Modelled cost of decoding batches of ``rows`` (``[K]`` counts) whose longest prompt is ``longest_prompt``:
    every row is padded to it in the prefill and attends over it at every step; each batch pays its steps'
    fixed cost."""
    per_row = (max_new_tokens * (longest_prompt + max_new_tokens / 2)
               + longest_prompt * (PREFILL_TOKEN_COST + PREFILL_PAIR_COST * longest_prompt))
    per_batch = max_new_tokens * STEP_COST if by_cost else UNMODELLED_BATCH_COST
    return per_batch + rows * per_row


def length_batches(prompt_lengths: list[int], max_new_tokens: int, max_rows: int | None, max_tokens: int | None,
                   by_cost: bool = True) -> list[list[int]]:
    """Row indices in decoding batches: the rows sorted by prompt length (stably), cut into consecutive
    batches that fit ``max_rows`` and ``max_tokens`` (cache positions: rows x (longest prompt +
    max_new_tokens); one row always fits) at the least modelled cost (``batch_costs``; ``by_cost=False``:
    the fewest batches, then the least padding). One batch keeps the rows in the given order."""
    order = sorted(range(len(prompt_lengths)), key=prompt_lengths.__getitem__)
    lengths = [prompt_lengths[i] for i in order]

    def run_costs(end: int) -> np.ndarray:
        rows = end - np.arange(end)  # [end] rows of a last batch starting at each index
        costs = batch_costs(rows, lengths[end - 1], max_new_tokens, by_cost)
        too_big = rows > (len(order) if max_rows is None else max_rows)
        if max_tokens is not None:
            too_big |= (rows > 1) & (rows * (lengths[end - 1] + max_new_tokens) > max_tokens)
        costs[too_big] = np.inf
        return costs

    runs = cheapest_runs(len(order), run_costs)
    if len(runs) <= 1:
        return [list(range(len(order)))]
    return [order[begin:end] for begin, end in runs]


def compacts(running: torch.Tensor) -> bool:
    """Whether to drop the ended rows of a batch (``running`` [R]): once a quarter of them have ended. Each
    drop copies the cache of every row kept, which costs more than carrying a few ended rows for some
    steps: sampled Arith batches of 64-500 rows decode in 7-19% less time than when each row is dropped as
    it ends (1 thread)."""
    ended = len(running) - int(running.sum())
    return 4 * ended >= len(running)
