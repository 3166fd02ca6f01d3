"""The tiny team model: the policy taught the roles of the built-in workflows (``envs.workflows``).

The tiny policy has only ever seen single-agent Arith prompts; a verifier's prompt (the problem, the
solver's solution under ``[solver]``, an instruction) is out of its distribution, so it never writes
a verdict, and RL cannot discover a line it never samples. The team model is the policy checkpoint
fine-tuned for ``team_steps`` more steps (a LoRA merged afterwards, ``team_rank``) on examples of each
role, with prompts built by the workflows' own prompt builders so that they match the env's
observations exactly, each answered by a solution of the problem (``team_targets``: the policy's own
greedy solution of the problem alone, by default, or the reference):

- verifier (the chain's, which verifies by solving again): the solver's solution (reference, or with
  one slip) -> a solution, so that it agrees with right solutions as often as it solves;
- refiner: the solver's solution and the verifier's, which disagree (at least one has a slip) -> a
  solution;
- debater, round 2: the other debaters' solutions (each reference or with a slip) -> a solution;
- solver: the single-agent prompt -> a solution (keeps the plain solving skill in the mix).

Taught the policy's own solutions, every role starts at the policy's skill, so the team's RL has what
the policy's has to learn. The verifier solves again rather than writing a verdict line because a model
this small does not learn to judge a verdict line (equality of two digit strings), while solving again is
the skill it has.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from envs.datasets import Problem
from envs.prompts import DEFAULT_TEMPLATE, format_prompt, join_steps, split_steps
from envs.grader import extract_answer
from envs.workflows import Message, TurnContext, Workflow, chain, debate
from models.tiny.config import TinyConfig
from models.tiny.data import corrupt_solution, reply_batch
from models.tiny.evaluation import first_boxed_integer, greedy_completions
from models.tiny.training import adamw, sft_loss, train_step, warmup_cosine

log = logging.getLogger(__name__)

ROLES = ("verifier", "refiner", "debater", "solver")
ROLE_SHARES = (0.25, 0.3, 0.3, 0.15)
"""Share of each role in a batch."""


def _solution(problem: Problem, rng: np.random.Generator, clean_fraction: float) -> tuple[str, bool]:
    """A solution text to ``problem`` as the env keeps a message (stripped), and whether it is right."""
    steps, labels = corrupt_solution(problem, rng, clean_fraction)
    return join_steps(steps).strip(), all(labels)


CHAIN, DEBATE = chain(), debate(3, 2)
"""The built-in workflows whose roles the team model learns, with the env's default arguments."""


def _prompt(workflow: Workflow, slot: int, problem: Problem, transcript: tuple[Message, ...], turn: int) -> str:
    return workflow.roles[slot].build_prompt(TurnContext(problem.problem, DEFAULT_TEMPLATE, transcript, slot, turn))


def _verifier_prompt(problem: Problem, solution: str) -> str:
    return _prompt(CHAIN, 1, problem, (Message(0, 0, "solver", solution),), 1)


def role_example(role: str, problem: Problem, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, target text) of one example of ``role`` on ``problem``."""
    reference = join_steps(split_steps(problem.solution))
    if role == "verifier":
        return _verifier_prompt(problem, _solution(problem, rng, clean_fraction=0.5)[0]), reference
    if role == "refiner":
        solution, right = _solution(problem, rng, clean_fraction=0.5)
        check, _ = _solution(problem, rng, clean_fraction=0.0 if right else 0.5)
        said = (Message(0, 0, "solver", solution), Message(1, 1, "verifier", check))
        return _prompt(CHAIN, 2, problem, said, 2), reference
    if role == "debater":
        said = tuple(Message(0, slot, f"debater_{slot}", _solution(problem, rng, clean_fraction=0.5)[0])
                     for slot in range(3))
        return _prompt(DEBATE, int(rng.integers(3)), problem, said, 1), reference
    if role == "solver":
        return format_prompt(problem.problem), reference
    raise ValueError(f"role={role!r} must be one of {ROLES}")


def team_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], rng: np.random.Generator,
               replies: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``data.reply_batch`` of one example per problem, its role drawn by ``ROLE_SHARES``; each example's reply
    is ``replies[i]`` (``[len(problems)]``), or the problem's reference solution."""
    roles = rng.choice(len(ROLES), size=len(problems), p=ROLE_SHARES)
    examples = [role_example(ROLES[r], p, rng) for r, p in zip(roles, problems)]
    if replies is None:
        replies = [reply for _, reply in examples]
    return reply_batch(tokenizer, [prompt for prompt, _ in examples], replies)


def own_solutions(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> list[str]:
    """``model``'s greedy solution of each problem alone (the single-agent prompt), as the env keeps a message."""
    return [text.strip() for text in greedy_completions(model, tokenizer, [format_prompt(p.problem) for p in problems])]


def train_team(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, config: TinyConfig,
               batches: Iterator[list[Problem]], seed: int, device: str) -> LlamaForCausalLM:
    """``model`` (the policy checkpoint) fine-tuned for ``team_steps`` on ``team_batch``es, lr ``team_lr`` with a
    short warmup and a cosine decay: a LoRA of rank ``team_rank`` (alpha twice the rank, every linear layer)
    merged into the weights afterwards, or every weight (rank 0). The replies (``team_targets``) are the
    references, or what the policy itself writes for each problem alone: then every role learns its
    prompt's format at the policy's skill, and RL has the room it has from the policy. (Taught the
    references, the team solves about 0.5, above where GRPO lifts the tiny models at the default run's
    flags: neither that team nor the tiny target gains under it.)"""
    rng = np.random.default_rng(seed)
    steps = [next(batches) for _ in range(config.team_steps)]
    # The policy's replies, all written before training: greedy_completions' batches of 500 rows take about
    # two thirds of the time of one 64-row call per step, and give the same replies.
    replies = None
    if config.team_targets == "policy":
        started = time.perf_counter()
        every_problem = [p for problems in steps for p in problems]
        replies = iter(own_solutions(model, tokenizer, every_problem))
        log.info("team stage: the policy's own solutions of %d problems in %.0f s", len(every_problem),
                 time.perf_counter() - started)
    if config.team_rank:
        from peft import LoraConfig, get_peft_model  # imported here: peft takes seconds to import

        torch.manual_seed(seed)  # the LoRA's initial weights: the same whatever ran before in this process
        model = get_peft_model(model, LoraConfig(r=config.team_rank, lora_alpha=2 * config.team_rank,
                                                 target_modules="all-linear", lora_dropout=0.0))
    optimizer = adamw(model, config.team_lr, config.weight_decay)
    model.train()
    for step, problems in enumerate(steps, start=1):
        step_replies = [next(replies) for _ in problems] if replies is not None else None
        ids, target_mask = team_batch(tokenizer, problems, rng, step_replies)
        loss, _ = sft_loss(model, ids.to(device), target_mask.to(device))
        train_step(model, optimizer, loss, warmup_cosine(config.team_lr, step, config.team_steps, config.warmup_steps))
    if config.team_rank:
        model = model.merge_and_unload()
    return model.eval()


def team_metrics(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                 seed: int) -> dict:
    """Greedy measures of each role on held-out ``problems``: the verifier's verdict accuracy on half right,
    half slipped solutions (and how often it gives a verdict at all) and its own answers' accuracy, and the
    accuracy of the refiner, of a round-2 debater and of the plain solver."""
    rng = np.random.default_rng(seed)
    metrics = {}
    for role in ROLES:
        if role == "verifier":
            shown = [_solution(p, rng, clean_fraction=0.5) for p in problems]
            prompts = [_verifier_prompt(p, solution) for p, (solution, _) in zip(problems, shown)]
        else:
            prompts = [role_example(role, p, rng)[0] for p in problems]
        completions = greedy_completions(model, tokenizer, prompts, max_new_tokens=64)
        metrics[f"{role}_accuracy"] = float(np.mean([first_boxed_integer(c) == p.answer
                                                     for c, p in zip(completions, problems)]))
        if role == "verifier":
            verdicts = [CHAIN.roles[1].verdict(c, extract_answer(solution))
                        for c, (solution, _) in zip(completions, shown)]
            metrics["verifier_verdict_accuracy"] = float(np.mean([(v is True) == right
                                                                   for v, (_, right) in zip(verdicts, shown)]))
            metrics["verifier_parsed"] = float(np.mean([v is not None for v in verdicts]))
    return metrics
