"""Final-answer extraction and safe, time-bounded equivalence of MATH answers: the grader's public entry point.

``extract_answer`` takes the content of the last ``\\boxed{}``/``\\fbox{}`` (or the text after "The answer
is"); ``is_equiv`` and ``grade_batch`` decide whether a model's answer equals the gold one, in three tiers:
a LaTeX-aware string and number fast path in the caller (``strings_equiv`` alone), a bounded parser that
builds sympy objects in worker processes, and a deadline on every call after which its worker is killed.
Model text is untrusted: nothing here hands it to Python's or sympy's evaluators, and every call returns
within its timeout, from any thread. The same workers run the other scorers (``scorers.SCORERS``):
math-verify's equivalence (``grader="math_verify"``) and reasoning-gym's own dataset scorers
(``reasoning_gym_scores``), whose packages their template process imports once. Where public graders
disagree: bare comma-separated answers compare as sets, parenthesised tuples in order; unreduced fractions
equal reduced ones; ``10\\%`` equals ``10`` and ``0.1``; ``2\\frac{1}{2}`` is a mixed number; ``3e5`` is 300000.

One concern a module: ``extraction`` (the answer in a text), ``normalization`` (canonical strings, plain
numbers), ``parsing`` (answer -> bounded sympy value), ``comparison`` (the string and symbolic verdicts),
``scorers`` (what a worker runs), ``workers`` (the process pool and its deadlines), ``limits`` (the bounds
they share). The names below are the grader's API; the rest of the project imports them from here.
"""

from __future__ import annotations

import time
from typing import Sequence

from envs.modes import Grader, member_of

from .comparison import fast_verdict
from .extraction import describe, extract_answer
from .scorers import math_verify_equiv, scorer_packages
from .workers import WORKER_START_TIMEOUT, Worker, get_pool

__all__ = ["extract_answer", "grade_batch", "is_equiv", "math_verify_equiv", "reasoning_gym_scores",
           "scorer_packages", "strings_equiv", "warm_up"]


def _check_inputs(pred, gold, timeout: float) -> None:
    if pred is not None and not isinstance(pred, str):
        raise TypeError(f"pred must be a str or None, got {describe(pred)}")
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a str, got {describe(gold)}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


def is_equiv(pred: str, gold: str, timeout: float = 1.0) -> bool:
    """Whether the answer ``pred`` equals the reference ``gold`` (see the module docstring).
    Returns within ``timeout`` seconds from any thread; False when the time runs out, which
    includes the workers' one-time start-up on a first call (``warm_up()`` does that ahead)."""
    _check_inputs(pred, gold, timeout)
    if pred is None:
        return False
    deadline = time.monotonic() + timeout
    verdict = fast_verdict(pred, gold)
    if verdict is not None:
        return verdict
    return get_pool().grade([[Grader.MATHRL, pred, gold]], timeout, deadline)[0] == 1.0


def strings_equiv(a: str, b: str) -> bool:
    """Whether the answers ``a`` and ``b`` are equal at the string level: the same after normalisation
    (wrappers, spacing, units, ...), or the same plain number. No symbolic tier, so it is pure, quick and
    needs no worker; False where only the symbolic tier could tell (``\\sqrt{4}`` against ``2``)."""
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, str):
            raise TypeError(f"strings_equiv: {name} must be a str, got {describe(value)}")
    return fast_verdict(a, b) is True


def grade_batch(preds: Sequence[str | None], golds: Sequence[str], timeout: float = 1.0,
                grader: Grader = Grader.MATHRL) -> list[bool]:
    """``[is_equiv(p, g) for p, g in zip(preds, golds)]`` with the symbolic ones spread over the
    worker pool; each item is bounded by ``timeout`` seconds once a worker takes it. None -> False.
    ``grader`` ``Grader.MATH_VERIFY`` sends every item to ``math_verify_equiv`` in the workers.
    The first call in a process also waits for the pool's one-time start-up (about a second, at
    most ``WORKER_START_TIMEOUT``), so that a cold start does not grade right answers False."""
    if len(preds) != len(golds):
        raise ValueError(f"grade_batch got {len(preds)} preds but {len(golds)} golds")
    grader = member_of(tuple(Grader), grader, "grader")
    verdicts, pending = [], []
    for index, (pred, gold) in enumerate(zip(preds, golds)):
        _check_inputs(pred, gold, timeout)
        verdict = False if pred is None else fast_verdict(pred, gold) if grader is Grader.MATHRL else None
        if verdict is None:
            pending.append(index)
        verdicts.append(bool(verdict))
    scores = _worker_scores(grader, [[preds[i], golds[i]] for i in pending], timeout)
    for index, score in zip(pending, scores):
        verdicts[index] = score == 1.0
    return verdicts


def reasoning_gym_scores(answers: Sequence[str | None], sources: Sequence[str], timeout: float = 1.0) -> list[float]:
    """``reasoning_gym_score`` of each answer (None scores 0) in the worker pool, each bounded by ``timeout``
    seconds once a worker takes it (an overrun scores 0)."""
    if len(answers) != len(sources):
        raise ValueError(f"reasoning_gym_scores got {len(answers)} answers but {len(sources)} sources")
    for answer, source in zip(answers, sources):
        _check_inputs(answer, source, timeout)
    pending = [i for i, answer in enumerate(answers) if answer is not None]
    scores = [0.0] * len(answers)
    for index, score in zip(pending, _worker_scores("reasoning_gym", [[answers[i], sources[i]] for i in pending],
                                                    timeout)):
        scores[index] = score
    return scores


def _worker_scores(scorer: str, requests: list[list], timeout: float) -> list[float]:
    """``SCORERS[scorer](*request)`` of each request in the pool (none: no pool needed)."""
    if not requests:
        return []
    pool = get_pool(preload=scorer_packages(scorer))
    pool.wait_started(WORKER_START_TIMEOUT)
    return pool.grade([[scorer, *request] for request in requests], timeout)


def warm_up(workers: int | None = None, timeout: float = WORKER_START_TIMEOUT, scorers: Sequence[str] = ()) -> None:
    """Start the worker pool now (``workers`` processes, default min(2, cpu_count); the packages of ``scorers``,
    keys of ``SCORERS``, imported ahead) and wait until all are ready, so that the first graded answers do not
    spend their timeout on start-up."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    pool = get_pool(workers, frozenset().union(*map(scorer_packages, scorers)))
    deadline = time.monotonic() + timeout
    ready: list[Worker] = []
    while len(ready) < pool.size and time.monotonic() < deadline:
        ready += pool.take(pool.size - len(ready), deadline)
    pool.give_back(ready)
    if len(ready) < pool.size:
        raise TimeoutError(f"only {len(ready)} of {pool.size} grading workers started within {timeout} s")
