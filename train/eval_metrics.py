"""Metrics of n sampled solutions per held-out problem, as papers report them.

- ``pass@k``: the chance that at least one of k solutions is right, by the unbiased estimator of Chen et
  al. (2021, "Evaluating Large Language Models Trained on Code"): with c of the n samples right,
  1 - C(n-c, k) / C(n, k) per problem, averaged over problems.
- ``maj@k``: majority voting (self-consistency) over the first k samples: their answers are grouped by
  the grader's equality (``envs.grader``: "1/2", "0.5" and "\\frac{1}{2}" are one answer), the largest
  group wins, and the vote is right iff the winning group's first sample is. Samples without a
  readable answer do not vote (none readable: wrong); a tie goes to the group whose first sample came
  first.
- ``mean@n``: the mean accuracy of all n samples.

k runs over 1, 2, 4, ... below n, and n (``maj@k`` from k = 2: maj@1 is the first sample's accuracy).
They are logged as ``pass_at_k``, ``maj_at_k`` and ``mean_at_n`` (a TensorBoard tag holds no '@'). Every value
leaves as a sum over problems, so that ranks add theirs before dividing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from envs.grader import grade_batch


def sample_sizes(n: int) -> list[int]:
    """The k that pass@k and maj@k are logged for with n samples per problem: powers of two below n, and n."""
    return [1 << i for i in range(n.bit_length()) if 1 << i < n] + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of n samples (c of them right), drawn without replacement,
    hold a right one; as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which stays exact for large n."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def answer_equality(answers: Sequence[Sequence[str | None]], timeout: float = 1.0) -> list[np.ndarray]:
    """Per problem, [n, n] bool: whether samples i and j gave answers the grader judges equal (False where
    either has none). Each problem's distinct answers are compared pairwise (the later one as the
    prediction, the earlier as the reference), every pair of every problem in one ``grade_batch`` call:
    at most u(u-1)/2 comparisons for u distinct answers, each bounded by ``timeout`` seconds."""
    distinct = [list(dict.fromkeys(a for a in row if a is not None)) for row in answers]
    pairs = [(p, i, j) for p, values in enumerate(distinct) for j in range(len(values)) for i in range(j)]
    verdicts = grade_batch([distinct[p][j] for p, _, j in pairs], [distinct[p][i] for p, i, _ in pairs],
                           timeout=timeout)
    same = [np.eye(len(values), dtype=bool) for values in distinct]
    for (p, i, j), verdict in zip(pairs, verdicts):
        same[p][i, j] = same[p][j, i] = verdict
    equality = []
    for row, values, table in zip(answers, distinct, same):
        index = np.array([values.index(a) if a is not None else -1 for a in row], dtype=np.int64)
        table = np.pad(table, (0, 1))  # index -1, no answer: the added row and column, equal to nothing
        equality.append(table[index][:, index])
    return equality


def majority_correct(equal: np.ndarray, correct: np.ndarray) -> float:
    """Whether the majority answer of a problem's samples is right (see the module docstring). ``equal``
    [k, k] bool: ``answer_equality`` of these samples; ``correct`` [k]: each sample's verdict."""
    k = len(correct)
    readable = equal.diagonal()
    if not readable.any():
        return 0.0
    first = np.arange(k)  # each sample's group, named by its first sample: answers chain (a ~ b ~ c is one group)
    while True:
        joined = np.where(equal, first[None, :], k).min(axis=1)
        joined = np.where(readable, joined, first)
        if np.array_equal(joined, first):
            break
        first = joined
    votes = np.bincount(first[readable], minlength=k)
    return float(correct[int(np.argmax(votes))])  # argmax: the first of the tied groups


def sampled_sums(correct: np.ndarray, answers: Sequence[Sequence[str | None]] | None,
                 timeout: float = 1.0) -> dict[str, float]:
    """Sums over problems of pass@k, maj@k (only with ``answers``) and mean@n. ``correct`` [P, n] float: each
    sample's verdict (1.0 / 0.0); ``answers`` [P][n]: each sample's extracted answer, None where none."""
    n = correct.shape[1]
    right = correct.sum(axis=1).astype(int)
    sums = {f"pass_at_{k}": sum(pass_at_k(n, int(c), k) for c in right) for k in sample_sizes(n)}
    if answers is not None:
        equality = answer_equality(answers, timeout)
        for k in sample_sizes(n)[1:]:
            sums[f"maj_at_{k}"] = sum(majority_correct(equal[:k, :k], row[:k]) for equal, row in zip(equality, correct))
    sums[f"mean_at_{n}"] = float(correct.mean(axis=1).sum())
    return sums
