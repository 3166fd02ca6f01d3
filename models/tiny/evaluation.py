"""Measures of the tiny models on Arith: greedy accuracy of a solver, step scores of a PRM.

The build uses them to pick the policy checkpoint and to write metrics.json; the slow tests use
them to check a finished build.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from algorithms.base import roc_auc
from envs.datasets import Problem, solve_steps
from envs.prompts import format_prompt, join_steps, split_steps
from models.packing import left_padded
from models.tiny.data import OFFSETS, corrupt_first_step, corrupt_solution, label_token_ids, parse_arith, prm_batch

BOXED_INTEGER = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


@torch.no_grad()
def greedy_completions(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str],
                       max_new_tokens: int = 64, batch_size: int = 500) -> list[str]:
    """Greedy continuations of ``prompts`` (batched, left padding), without the prompt and eos."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    completions = []
    for start in range(0, len(prompts), batch_size):
        encoded = tokenizer(prompts[start: start + batch_size])["input_ids"]
        ids, attention_mask = left_padded(encoded, tokenizer.pad_token_id, device)
        out = model.generate(input_ids=ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        completions += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return completions


def first_boxed_integer(text: str) -> str | None:
    """The integer in the first ``\\boxed{}`` (the env ends an episode at the first one)."""
    match = BOXED_INTEGER.search(text)
    return match.group(1) if match else None


def arith_accuracy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                   prefixes: list[list[str]] | None = None) -> float:
    """Greedy accuracy on Arith ``problems``, optionally continuing from given prefix steps."""
    prefixes = prefixes if prefixes is not None else [[] for _ in problems]
    prompts = [format_prompt(p.problem) + join_steps(prefix) for p, prefix in zip(problems, prefixes)]
    answers = [first_boxed_integer(c) for c in greedy_completions(model, tokenizer, prompts)]
    return float(np.mean([a == p.answer for a, p in zip(answers, problems)]))


def prefix_metrics(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                   seed: int) -> dict:
    """Greedy accuracy from scratch, after the first reference step, and after a corrupted one."""
    rng = np.random.default_rng(seed)
    correct = [split_steps(p.solution)[:1] for p in problems]
    corrupted = [corrupt_first_step(p, rng) for p in problems]
    return {
        "accuracy": arith_accuracy(model, tokenizer, problems),
        "correct_prefix_accuracy": arith_accuracy(model, tokenizer, problems, correct),
        "corrupted_prefix_accuracy": arith_accuracy(model, tokenizer, problems, corrupted),
    }


@torch.no_grad()
def prm_step_scores(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                    solutions: list[list[str]], batch_size: int = 250) -> np.ndarray:
    """[S] P("+") over {"+", "-"} at each step tag, for all steps of all solutions in order."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    label_ids = label_token_ids(tokenizer).to(device)
    scores = []
    for start in range(0, len(problems), batch_size):
        chunk = slice(start, start + batch_size)
        dummy_labels = [[1] * len(steps) for steps in solutions[chunk]]
        ids, tag_mask, *_ = prm_batch(tokenizer, problems[chunk], solutions[chunk], dummy_labels)
        logits = model(input_ids=ids.to(device)).logits[tag_mask.to(device)][:, label_ids]
        scores.append(logits.float().softmax(-1)[:, 0].cpu())
    model.train(was_training)
    return torch.cat(scores).numpy()


def prm_metrics(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                seed: int, clean_fraction: float = 0.4) -> dict:
    """Step-label accuracy (P("+") > 0.5) and ROC-AUC on corrupted solutions of ``problems``."""
    rng = np.random.default_rng(seed)
    solutions, labels = zip(*(corrupt_solution(p, rng, clean_fraction) for p in problems))
    scores = prm_step_scores(model, tokenizer, problems, list(solutions))
    flat_labels = np.array([label for row in labels for label in row])
    return {"step_accuracy": float(np.mean((scores > 0.5) == flat_labels)), "auc": roc_auc(scores, flat_labels),
            "num_steps": int(len(flat_labels)), "good_fraction": float(flat_labels.mean())}


def prm_last_step_auc(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
                      seed: int) -> dict:
    """ROC-AUC of the last step's score, correct vs result-corrupted, after a correct prefix of
    random length: overall ("auc") and per step index ("by_step"; "answer" for the boxed step)."""
    rng = np.random.default_rng(seed)
    good, bad, steps_of = [], [], []
    for problem in problems:
        operands, ops = parse_arith(problem)
        k = int(rng.integers(len(ops) + 1))
        good.append(solve_steps(operands, ops)[0][: k + 1])
        bad.append(solve_steps(operands, ops, k, "result", int(rng.choice(OFFSETS)))[0][: k + 1])
        steps_of.append("answer" if k == len(ops) else str(k))
    last = np.cumsum([len(s) for s in good]) - 1
    scores = np.concatenate([prm_step_scores(model, tokenizer, problems, good)[last],
                             prm_step_scores(model, tokenizer, problems, bad)[last]])
    labels, keys = np.repeat([1, 0], len(problems)), np.array(steps_of * 2)
    return {"auc": roc_auc(scores, labels),
            "by_step": {key: roc_auc(scores[keys == key], labels[keys == key]) for key in sorted(set(steps_of))}}
