"""What a Prefix-RL group carries: the writer's prefixes, what the frozen target makes of them, and the signal
a group of them gives the writer.

    python -m bench.prefix_signal [--writer DIR] [--target DIR] [--problems 24] [--group_size 8]
                                  [--temperatures 0.3 1.0] [--prefix_tokens 32] [--target_tokens 128] [--seed 0]

On problems drawn from the real-model bench's task (``bench.real_model_learning.ARITH``) under the chat
template and answer instruction that ``train_math.py`` renders: the writer samples ``--group_size`` prefixes
of at most ``--prefix_tokens`` tokens per problem at each temperature; the target continues each greedily for
at most ``--target_tokens``; the answer is read from prefix and continuation together, as ``Arith-Prefix-v0``
reads it. One line per temperature: the team's accuracy, the share of groups holding a right and a wrong
answer (the groups that give GRPO a non-zero advantage), distinct prefixes per group, the prefixes' mean
length and the share already holding an answer the grader can read, and the accuracy of the writer finishing
its own prefixes (greedily, same budget). Then one example prefix and continuation per temperature.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Sequence

import torch

from bench.real_model_learning import ARITH, default_model
from envs.datasets import Arith
from envs.grader import extract_answer, grade_batch
from envs.prompts import format_prompt
from models.generation import HFGenerator
from models.policy import LanguagePolicy
from models.prompting import build_template
from train.config import ANSWER_INSTRUCTION


def team_outcomes(writer: HFGenerator, target: HFGenerator, prompts: list[str], golds: list[str],
                  args: argparse.Namespace, temperature: float) -> dict[str, object]:
    """The group statistics of the module docstring at one writer temperature."""
    n = args.group_size
    prefixes = writer.generate(prompts, n=n, max_new_tokens=args.prefix_tokens, temperature=temperature,
                               seed=args.seed)
    rows = [prompts[i // n] + text for i, text in enumerate(prefixes.texts)]
    golds_by_row = [golds[i // n] for i in range(len(rows))]
    budget = args.target_tokens
    continued = target.generate(rows, max_new_tokens=budget, temperature=0.0).texts
    alone = writer.generate(rows, max_new_tokens=budget, temperature=0.0).texts
    team = grade_batch([extract_answer(p + c) for p, c in zip(prefixes.texts, continued)], golds_by_row)
    writer_alone = grade_batch([extract_answer(p + c) for p, c in zip(prefixes.texts, alone)], golds_by_row)
    groups = [team[g * n:(g + 1) * n] for g in range(len(prompts))]
    return {"temperature": temperature, "team": statistics.fmean(team), "writer_alone": statistics.fmean(writer_alone),
            "mixed_groups": statistics.fmean(0 < sum(group) < n for group in groups),
            "distinct": statistics.fmean(len(set(prefixes.texts[g * n:(g + 1) * n])) for g in range(len(prompts))),
            "prefix_tokens": statistics.fmean(len(ids) for ids in prefixes.token_ids),
            "answer_in_prefix": statistics.fmean(extract_answer(text) is not None for text in prefixes.texts),
            "example": (prefixes.texts[0], continued[0], team[0])}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writer", default=None, help="The writer's model directory (default: SmolLM2-135M-Instruct "
                        "in the cache).")
    parser.add_argument("--target", default=None, help="The frozen target's directory (default: the same model).")
    parser.add_argument("--problems", type=int, default=24)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 1.0])
    parser.add_argument("--prefix_tokens", type=int, default=32)
    parser.add_argument("--target_tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.writer = args.writer or default_model()
    args.target = args.target or default_model()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    writer_policy = LanguagePolicy(args.writer, device="cpu").eval()
    target_policy = writer_policy if args.target == args.writer else LanguagePolicy(args.target, device="cpu").eval()
    template = build_template("chat", writer_policy.tokenizer, answer_instruction=ANSWER_INSTRUCTION)
    task = Arith(**{key: ARITH[key] for key in ("digits", "min_ops", "max_ops", "operators")})
    problems = task.problems(args.problems, seed=args.seed + 1)
    prompts = [format_prompt(problem.problem, template) for problem in problems]
    golds = [problem.answer for problem in problems]
    with torch.no_grad():
        for temperature in args.temperatures:
            result = team_outcomes(HFGenerator(writer_policy), HFGenerator(target_policy), prompts, golds, args,
                                   temperature)
            prefix, continuation, right = result.pop("example")
            print(" ".join(f"{key} {value:.3f}" for key, value in result.items()), flush=True)
            print(f"  example ({'right' if right else 'wrong'}): {prefix!r} || {continuation[:160]!r}", flush=True)


if __name__ == "__main__":
    main()
