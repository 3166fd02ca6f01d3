"""What the tiny models train and are measured on: Arith problems, SFT batches, corrupted solutions.

The policy and target learn Arith reference solutions; the PRM learns to tell them from solutions
with one slip (``corrupt_solution``), labelled the Math-Shepherd way: a step is good only if it and
every step before it are correct. Batches are right-padded with masks taken from true lengths.
"""

from __future__ import annotations

import functools
import re
from typing import Iterator

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from envs.datasets import Arith, Problem, solve_steps
from envs.prompts import SHEPHERD_STEP_TAG, format_prompt, join_steps, shepherd_text, split_steps
from models.packing import right_padded
from models.tiny.config import TinyConfig

GOOD_TOKEN, BAD_TOKEN = "+", "-"
"""The PRM reads P(GOOD_TOKEN) vs P(BAD_TOKEN) at each step tag; both are single tokens."""
PRM_ANCHOR = "Solution"
"""The last word of envs.prompts.DEFAULT_TEMPLATE: the PRM checks the text after it (the problem's
own numbers cannot be predicted). One token in the tiny tokenizer."""

ARITH_PROBLEM = re.compile(r"Compute (.+)\.")
OFFSETS = (-20, -11, -10, -9, -2, -1, 1, 2, 9, 10, 11, 20)
"""Error sizes: last-digit slips and carry errors, the mistakes a tiny policy makes."""


def heldout_problems(config: TinyConfig = TinyConfig()) -> list[Problem]:
    """The ``num_eval`` Arith problems the build never trains on, behind every reported figure.
    (Use these to re-measure: two-digit one-operation problems are few enough that a fresh random
    set mostly repeats problems the models trained on.)"""
    return config.arith().problems(config.num_eval, seed=config.seed + 1_000_003)


def arith_batches(arith: Arith, batch_size: int, seed: int, exclude: set[str]) -> Iterator[list[Problem]]:
    """An endless stream of training problems (lists of ``batch_size``), each problem once and none
    in ``exclude``. Once the few one-operation problems are used up the stream holds longer ones,
    which carry more steps per token."""
    rng = np.random.default_rng(seed)
    seen = set(exclude)
    while True:
        batch = []
        while len(batch) < batch_size:
            problem = arith.sample(rng)
            if problem.id not in seen:
                seen.add(problem.id)
                batch.append(problem)
        yield batch


def sft_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], step_tags: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + reference solution + eos, tokenized apart as the policy sees them at generation
    (with ``step_tags``, the solution in Math-Shepherd format, as the PRM reads it).

    Returns ids [B, L] right-padded and target_mask [B, L-1]: True where position t+1 is a
    solution (or eos) token, i.e. where the logits at t are trained.
    """
    format_steps = functools.partial(shepherd_text, "") if step_tags else join_steps
    return reply_batch(tokenizer, [format_prompt(p.problem) for p in problems],
                       [format_steps(split_steps(p.solution)) for p in problems])


def reply_batch(tokenizer: PreTrainedTokenizerFast, prompts: list[str], replies: list[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt + its reply + eos, tokenized apart: ids [B, L] right-padded and target_mask [B, L-1],
    True where position t+1 is a reply (or eos) token, i.e. where the logits at t are trained."""
    prompt_ids = tokenizer(prompts)["input_ids"]
    reply_ids = tokenizer(replies)["input_ids"]
    ids, lengths = right_padded([p + r + [tokenizer.eos_token_id] for p, r in zip(prompt_ids, reply_ids)],
                                torch.device("cpu"))
    starts = torch.tensor([len(p) for p in prompt_ids])
    positions = torch.arange(1, ids.shape[1])
    return ids, (positions[None] >= starts[:, None]) & (positions[None] < lengths[:, None])


def parse_arith(problem: Problem) -> tuple[list[int], list[str]]:
    """(operands, operators) of an Arith problem text like ``Compute 57 + 25 - 43.``"""
    match = ARITH_PROBLEM.fullmatch(problem.problem)
    if match is None:
        raise ValueError(f"{problem.problem!r} is not an Arith problem ('Compute a op b ... .')")
    tokens = match.group(1).split(" ")
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def corrupt_solution(problem: Problem, rng: np.random.Generator, clean_fraction: float) -> tuple[list[str], list[int]]:
    """A solution to ``problem`` and its step labels (1 good, 0 bad; 0 from the first error on)."""
    operands, ops = parse_arith(problem)
    num_steps = len(ops) + 1
    if rng.random() < clean_fraction:
        return solve_steps(operands, ops)[0], [1] * num_steps
    error_step = int(rng.integers(num_steps))
    kind = "operand" if error_step < len(ops) and rng.random() < 0.3 else "result"
    steps, _ = solve_steps(operands, ops, error_step, kind, int(rng.choice(OFFSETS)))
    return steps, [1] * error_step + [0] * (num_steps - error_step)


def corrupt_first_step(problem: Problem, rng: np.random.Generator) -> list[str]:
    """The first reference step with its result off by a small offset."""
    operands, ops = parse_arith(problem)
    return solve_steps(operands, ops, 0, "result", int(rng.choice(OFFSETS)))[0][:1]


def prm_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], solutions: list[list[str]],
              labels: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L] right-padded shepherd texts; tag_mask [B, L] True at the real step tags;
    tag_labels [S] 1/0 and tag_steps [S] step index (-1 for the answer step) for the S tags in
    row-major order."""
    texts = [shepherd_text(format_prompt(p.problem), steps) for p, steps in zip(problems, solutions)]
    ids, lengths = right_padded(tokenizer(texts)["input_ids"], torch.device("cpu"))
    tag_id = tokenizer.convert_tokens_to_ids(SHEPHERD_STEP_TAG)
    real = torch.arange(ids.shape[1])[None] < lengths[:, None]
    tag_mask = (ids == tag_id) & real
    tag_labels = torch.tensor([label for row in labels for label in row])
    if int(tag_mask.sum()) != len(tag_labels):
        raise ValueError(f"found {int(tag_mask.sum())} step tags for {len(tag_labels)} step labels; "
                         f"a step must not contain {SHEPHERD_STEP_TAG!r}")
    tag_steps = torch.tensor([k if k < len(row) - 1 else -1 for row in labels for k in range(len(row))])
    return ids, tag_mask, tag_labels, tag_steps


def label_token_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """[2] ids of (GOOD_TOKEN, BAD_TOKEN)."""
    return torch.tensor([tokenizer.convert_tokens_to_ids(GOOD_TOKEN), tokenizer.convert_tokens_to_ids(BAD_TOKEN)])


def departure_tokens(tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                     rng: np.random.Generator) -> list[int]:
    """Ids of the tokens at which a corrupted solution of ``problems`` first departs from the
    reference, on either side (digits, signs, the space before a step tag, ...): the tokens whose
    likelihood the PRM checks. Sorted."""
    departures = set()
    for problem in problems:
        steps, _ = corrupt_solution(problem, rng, clean_fraction=0.0)
        prompt = format_prompt(problem.problem)
        texts = [shepherd_text(prompt, steps), shepherd_text(prompt, split_steps(problem.solution))]
        corrupted, reference = tokenizer(texts)["input_ids"]
        first = next(i for i, (a, b) in enumerate(zip(corrupted, reference)) if a != b)
        departures.update((corrupted[first], reference[first]))
    return sorted(departures)
