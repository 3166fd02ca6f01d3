"""Answer grading: throughput and agreement of envs.grader on the labelled cases, and of
math-verify when it is installed (``pip install -e ".[bench]"`` pins it; never a runtime dependency).

    python bench/grader.py [--repeats 13] [--batch-size 64] [--math-verify-repeats 3]

Grades the labelled cases repeated ``--repeats`` times (>= 2000 answers by default) after a
warm-up: with ``grade_batch`` in reward-model-sized batches, and with a loop of ``is_equiv``. The
first pass over the distinct cases (cold caches) is timed separately, since repeats let sympy's
cache in the workers help. math-verify grades with both sides in ``\\boxed{}``, ``parse`` then
``verify(gold, pred)``, in a single process (its timeouts use signals). Ends with a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from envs.grader import grade_batch, is_equiv, warm_up

DEFAULT_CASES = Path(__file__).resolve().parents[2] / "shared/data/grader_cases.jsonl"


def load_cases(path: Path) -> tuple[list[str], list[str], list[bool]]:
    if not path.exists():
        raise SystemExit(f"labelled cases not found at {path}; pass --cases PATH")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["pred"] for r in rows], [r["gold"] for r in rows], [r["expected"] for r in rows]


def batched(preds: list[str], golds: list[str], batch_size: int) -> list[bool]:
    verdicts = []
    for start in range(0, len(preds), batch_size):
        verdicts += grade_batch(preds[start:start + batch_size], golds[start:start + batch_size])
    return verdicts


def rate(function, preds: list[str], golds: list[str]) -> tuple[list[bool], float]:
    """(verdicts, answers per second)."""
    start = time.perf_counter()
    verdicts = function(preds, golds)
    return verdicts, len(preds) / (time.perf_counter() - start)


def math_verify_grader():
    """A (preds, golds) -> verdicts function using math-verify, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def grade(preds: list[str], golds: list[str]) -> list[bool]:
        return [bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")))
                for pred, gold in zip(preds, golds)]

    return grade


def agreement(verdicts: list[bool], expected: list[bool]) -> int:
    return sum(v == e for v, e in zip(verdicts, expected))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES, help="labelled cases (JSONL)")
    parser.add_argument("--repeats", type=int, default=13, help="passes over the cases per timing")
    parser.add_argument("--batch-size", type=int, default=64, help="answers per grade_batch call")
    parser.add_argument("--math-verify-repeats", type=int, default=3, help="passes for math-verify (~55/s)")
    args = parser.parse_args()

    preds, golds, expected = load_cases(args.cases)
    many_preds, many_golds = preds * args.repeats, golds * args.repeats
    print(f"{len(preds)} labelled cases; timed runs grade {len(many_preds)} answers")

    start = time.perf_counter()
    warm_up()
    print(f"worker pool started in {time.perf_counter() - start:.2f} s")
    ours, first_rate = rate(lambda p, g: batched(p, g, args.batch_size), preds, golds)
    batch_verdicts, batch_rate = rate(lambda p, g: batched(p, g, args.batch_size), many_preds, many_golds)
    loop_verdicts, loop_rate = rate(lambda p, g: [is_equiv(x, y) for x, y in zip(p, g)], many_preds, many_golds)
    assert batch_verdicts == loop_verdicts == ours * args.repeats, "grade_batch and is_equiv disagree"
    ours_agree = agreement(ours, expected)
    print(f"envs.grader: {ours_agree}/{len(preds)} agree; grade_batch {batch_rate:,.0f} answers/s "
          f"(first pass, cold caches: {first_rate:,.0f}/s); is_equiv loop {loop_rate:,.0f} answers/s")
    summary = (f"envs.grader {ours_agree}/{len(preds)} agree, grade_batch {batch_rate:,.0f}/s, "
               f"is_equiv {loop_rate:,.0f}/s")

    grade_mv = math_verify_grader()
    if grade_mv is None:
        print("math-verify: not installed (pip install math-verify to compare)")
    else:
        mv, _ = rate(grade_mv, preds, golds)  # warm-up and agreement
        _, mv_rate = rate(grade_mv, preds * args.math_verify_repeats, golds * args.math_verify_repeats)
        mv_agree = agreement(mv, expected)
        print(f"math-verify: {mv_agree}/{len(preds)} agree; {mv_rate:,.1f} answers/s (single process)")
        print(f"ratio: grade_batch is {batch_rate / mv_rate:,.0f}x math-verify's answers/s")
        summary += f" | math-verify {mv_agree}/{len(preds)} agree, {mv_rate:,.1f}/s | {batch_rate / mv_rate:,.0f}x"
    print(f"summary: {summary}")


if __name__ == "__main__":
    main()
