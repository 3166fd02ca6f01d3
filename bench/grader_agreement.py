"""Agreement of the two answer graders, this project's (``--grader mathrl``) and math-verify's
(``--grader math_verify``), on MATH-500's reference answers: each reference against itself, against rewritten
forms of it that keep its value, and against another problem's reference; and, with ``--tiny N``, the final
answers the shipped tiny policy (or, with ``--model DIR``, a real instruct model under its chat template)
writes (greedy, whole solutions) to N held-out Arith problems and N MATH-500 problems against their
references. Each pair through ``grade_batch`` in the bounded workers, as the reward and the evaluation grade.
Needs the math-verify extra.

    python bench/grader_agreement.py [--timeout 5] [--limit 500] [--tiny 0] [--model DIR] [--max_new_tokens 96]

Prints one row per kind of pair: pairs, how many each grader calls equal, and how many verdicts agree, then the
pairs they disagree on (at most ``--show`` of each kind).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Callable

from envs.datasets import MATH500, Problem, load_problems
from envs.grader import extract_answer, grade_batch, warm_up
from envs.prompts import format_prompt

INTEGER = re.compile(r"-?[0-9]+")


def variants(reference: str) -> dict[str, str | None]:
    """Rewritings of ``reference`` that keep its value (None where a rewriting does not apply)."""
    return {
        "itself": reference,
        "dfrac": reference.replace("\\frac", "\\dfrac") if "\\frac" in reference else None,
        "no spaces": reference.replace(" ", "") if " " in reference else None,
        "spaced commas": reference.replace(",", ", ") if "," in reference and ", " not in reference else None,
        "left-right": (reference.replace("(", "\\left(").replace(")", "\\right)")
                       if "(" in reference and "\\left" not in reference else None),
        "in dollars": f"${reference}$",
        "x = answer": f"x = {reference}" if "=" not in reference and "," not in reference else None,
        "integer as n.0": f"{reference}.0" if INTEGER.fullmatch(reference) else None,
    }


def wrong_ones(references: list[str]) -> dict[str, Callable[[int], str | None]]:
    """Pairs that should not be equal: the next problem's reference, an integer plus one."""
    return {
        "next problem's reference": lambda i: (references[(i + 1) % len(references)]
                                               if references[(i + 1) % len(references)] != references[i] else None),
        "integer plus one": lambda i: str(int(references[i]) + 1) if INTEGER.fullmatch(references[i]) else None,
    }


def model_pairs(problems: list[Problem], model: str | None, max_new_tokens: int) -> list[tuple[str, str]]:
    """(the final answer extracted from a model's greedy whole solution, the reference) for each problem it
    answers: the shipped tiny policy on the plain prompt (``model`` None), or the model in the directory
    ``model`` under its chat template with train_math's answer instruction (a real instruct model)."""
    from models.generation import make_generator
    from models.policy import LanguagePolicy
    from models.prompting import build_template
    from models.tiny import shipped_models
    from train.config import ANSWER_INSTRUCTION

    policy = LanguagePolicy(model or shipped_models(team=False).policy, device="cpu")
    template = (build_template("chat", policy.tokenizer, answer_instruction=ANSWER_INSTRUCTION) if model
                else None)
    prompts = [format_prompt(p.problem) if template is None else format_prompt(p.problem, template) for p in problems]
    texts = make_generator("hf", policy).generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0).texts
    answers = [extract_answer(text) for text in texts]
    return [(answer, p.answer) for answer, p in zip(answers, problems) if answer is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per answer, either grader")
    parser.add_argument("--limit", type=int, default=500, help="MATH-500 problems")
    parser.add_argument("--show", type=int, default=5, help="disagreements printed per kind")
    parser.add_argument("--tiny", type=int, default=0, help="problems of each set the model answers")
    parser.add_argument("--model", default=None, help="with --tiny: a real instruct model's directory answers, under "
                        "its chat template (default: the shipped tiny policy)")
    parser.add_argument("--max_new_tokens", type=int, default=96, help="with --tiny: tokens per solution")
    args = parser.parse_args()
    references = [json.loads(line)["answer"] for line in MATH500.read_text().splitlines()[:args.limit]]
    pairs: dict[str, list[tuple[str, str]]] = {}
    for reference in references:
        for kind, pred in variants(reference).items():
            if pred is not None:
                pairs.setdefault(kind, []).append((pred, reference))
    for kind, make in wrong_ones(references).items():
        pairs[kind] = [(pred, reference) for i, reference in enumerate(references) if (pred := make(i)) is not None]
    if args.tiny:
        from models.tiny.data import heldout_problems

        name = "tiny policy" if args.model is None else Path(args.model).name
        pairs[f"{name}, Arith held-out"] = model_pairs(heldout_problems()[:args.tiny], args.model, args.max_new_tokens)
        pairs[f"{name}, MATH-500"] = model_pairs(load_problems(MATH500, limit=args.tiny), args.model,
                                                 args.max_new_tokens)
    warm_up(scorers=("mathrl", "math_verify"))
    print(f"| pairs | n | mathrl: equal | math_verify: equal | verdicts agree |\n| --- | --- | --- | --- | --- |")
    shown = []
    for kind, kind_pairs in pairs.items():
        preds, golds = [p for p, _ in kind_pairs], [g for _, g in kind_pairs]
        ours = grade_batch(preds, golds, timeout=args.timeout)
        theirs = grade_batch(preds, golds, timeout=args.timeout, grader="math_verify")
        agree = sum(a == b for a, b in zip(ours, theirs))
        print(f"| {kind} | {len(kind_pairs)} | {sum(ours)} | {sum(theirs)} | {agree} ({agree / len(kind_pairs):.1%}) |")
        differ = [(p, g, a, b) for (p, g), a, b in zip(kind_pairs, ours, theirs) if a != b]
        shown += [f"{kind}: {p!r} vs {g!r}: mathrl {a}, math_verify {b}" for p, g, a, b in differ[:args.show]]
    print("\n".join(["disagreements:", *shown]))


if __name__ == "__main__":
    main()
