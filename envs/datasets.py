"""Problem records, loading them from JSONL / JSON / Hugging Face datasets, and the procedural
arithmetic task (``Arith``) that a tiny model can learn on a CPU."""

from __future__ import annotations

import functools
import json
import operator
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence, get_args

import numpy as np

from envs.prompts import STEP_DELIMITER

MATH500 = Path(__file__).resolve().parent / "data" / "math500.jsonl"
"""MATH-500 as shipped with the package (source and license: envs/data/README.md): MATH-v0's default problems."""


@dataclass(frozen=True)
class Problem:
    """One math problem. ``answer`` is the reference final answer in LaTeX (what goes in \\boxed{}); ``scorer``,
    where set, names the problem's own scorer, which grades its answers instead of the grader."""

    id: str
    problem: str
    answer: str
    solution: str | None = None
    subject: str | None = None
    level: int | None = None
    scorer: str | None = None  # JSON of the scorer (``envs.reasoning_gym_source``); None: the grader


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

PROBLEM_KEYS = ("problem", "question")
ANSWER_KEYS = ("answer", "final_answer")  # MATH-500 schema, OpenR schema
ID_KEYS = ("unique_id", "id", "idx")


def load_problems(
    path_or_name: str | os.PathLike,
    split: str | None = None,
    subjects: Sequence[str] | None = None,
    levels: Sequence[int] | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Loads problems from a JSONL file, a JSON array file, a directory holding ``{split}.jsonl``,
    or ``hf://NAME[:split]`` (needs the optional ``datasets`` package).

    Records follow the MATH-500 schema (``problem``, ``answer``, ``solution``, ``subject``, ``level``,
    ``unique_id``) or OpenR's (``final_answer`` instead of ``answer``). A record without an answer
    field takes the last ``\\boxed{}`` of its ``solution``. ``subjects`` (case-insensitive) and
    ``levels`` (integers 1-5) filter; ``limit`` keeps the first ``limit`` that pass.
    """
    source = str(path_or_name)
    if source.startswith("hf://"):
        records = _hf_records(source[len("hf://"):], split)
    else:
        records = _file_records(_resolve_path(Path(source), split))
    problems = [_to_problem(record, where) for where, record in records]
    kept = _filter(problems, subjects, levels)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit={limit} must be a positive number of problems (or None for all)")
        kept = kept[:limit]
    if not kept:
        raise ValueError(
            f"no problems left from {source!r}: {len(problems)} loaded, 0 kept by "
            f"subjects={list(subjects) if subjects else None}, levels={list(levels) if levels else None}; "
            f"subjects present: {sorted({p.subject for p in problems if p.subject})}, "
            f"levels present: {sorted({p.level for p in problems if p.level is not None})}"
        )
    return kept


def _resolve_path(path: Path, split: str | None) -> Path:
    if path.is_dir():
        candidate = path / f"{split or 'test'}.jsonl"
        if not candidate.is_file():
            raise FileNotFoundError(f"dataset directory {path} has no {candidate.name}; pass a file path or split=")
        return candidate
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist (cwd: {os.getcwd()}); pass a JSONL/JSON file path")
    return path


def _file_records(path: Path) -> list[tuple[str, Any]]:
    """(location, record) pairs; the location names file and line for error messages."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); save the "
                         "dataset as UTF-8") from None
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must hold an array of objects, found {type(data).__name__}")
        return [(f"{path}[{i}]", record) for i, record in enumerate(data)]
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
            ) from None
    return records


def _hf_records(name: str, split: str | None) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"hf://{name} needs the 'datasets' package: pip install 'mathrl[hf]'") from None
    name, _, name_split = name.partition(":")
    split = name_split or split or "test"
    dataset = datasets.load_dataset(name, split=split)
    return [(f"hf://{name}:{split}[{i}]", dict(record)) for i, record in enumerate(dataset)]


def _field(record: dict, keys: Sequence[str], where: str, required: bool) -> Any:
    for key in keys:
        if record.get(key) is not None:
            return record[key]
    if required:
        raise ValueError(f"{where}: missing field {' or '.join(map(repr, keys))}; the record has keys {sorted(record)}")
    return None


def _to_problem(record: Any, where: str) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(record).__name__}")
    problem = _field(record, PROBLEM_KEYS, where, required=True)
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}: field 'problem' must be a non-empty string, found {problem!r:.80}")
    solution = _field(record, ("solution",), where, required=False)
    answer = _field(record, ANSWER_KEYS, where, required=False)
    if answer is None and isinstance(solution, str):
        from envs.grader import extract_answer

        answer = extract_answer(solution)
    if answer is None:
        raise ValueError(
            f"{where}: missing field 'answer' or 'final_answer' (and no \\boxed{{}} in 'solution'); "
            f"the record has keys {sorted(record)}"
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: field 'answer' must be a string or number, found {type(answer).__name__}")
    level = _field(record, ("level",), where, required=False)
    return Problem(
        id=str(_field(record, ID_KEYS, where, required=False) or where),
        problem=problem,
        answer=str(answer),
        solution=solution if isinstance(solution, str) else None,
        subject=_field(record, ("subject", "type"), where, required=False),
        level=_parse_level(level, where),
    )


def _parse_level(level: Any, where: str) -> int | None:
    """``3``, ``"3"`` or ``"Level 3"`` -> 3; ``None`` or ``"Level ?"`` -> None."""
    if level is None or isinstance(level, int):
        return level
    match = re.fullmatch(r"\s*(?:level\s*)?(\d+|\?)\s*", str(level), flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"{where}: field 'level' must be an integer or 'Level N', found {level!r}")
    return None if match.group(1) == "?" else int(match.group(1))


def _filter(problems: list[Problem], subjects: Sequence[str] | None, levels: Sequence[int] | None) -> list[Problem]:
    if subjects:
        wanted = {s.lower() for s in subjects}
        problems = [p for p in problems if p.subject and p.subject.lower() in wanted]
    if levels:
        wanted_levels = set(levels)
        problems = [p for p in problems if p.level in wanted_levels]
    return problems


# --------------------------------------------------------------------------------------------
# Arith: procedural arithmetic with exact step-by-step solutions
# --------------------------------------------------------------------------------------------

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
PRECEDENCE = {"+": 0, "-": 0, "*": 1}


@dataclass(frozen=True)
class Arith:
    """Seeded generator of problems like ``Compute 57 + 25 + 65 - 43.``

    The reference solution performs one operation per step (multiplications first, then left to
    right), e.g. ``57 + 25 = 82``, and ends with the step ``The answer is \\boxed{104}.``; steps
    are joined by ``STEP_DELIMITER``, exactly the format the env and the tiny models use.

    Knobs: ``digits`` per operand, ``min_ops``..``max_ops`` operations, ``operators`` from "+-*".
    """

    digits: int = 2
    min_ops: int = 1
    max_ops: int = 3
    operators: str = "+-"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"Arith digits={self.digits} must be >= 1")
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"Arith needs 1 <= min_ops <= max_ops, got min_ops={self.min_ops}, max_ops={self.max_ops}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"Arith operators={self.operators!r} must be a non-empty subset of {''.join(OPERATORS)!r}")

    def sample(self, rng: np.random.Generator) -> Problem:
        """One random problem drawn with ``rng``."""
        low, high = (0 if self.digits == 1 else 10 ** (self.digits - 1)), 10**self.digits
        num_ops = int(rng.integers(self.min_ops, self.max_ops + 1))
        operands = [int(x) for x in rng.integers(low, high, size=num_ops + 1)]
        ops = [self.operators[i] for i in rng.integers(0, len(self.operators), size=num_ops)]
        expression = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(ops, operands[1:])])
        steps, answer = solve_steps(operands, ops)
        return Problem(
            id="arith:" + expression.replace(" ", ""),
            problem=f"Compute {expression}.",
            answer=str(answer),
            solution=STEP_DELIMITER.join(steps),
            subject="Arithmetic",
            level=num_ops,
        )

    def problems(self, n: int, seed: int, exclude: Iterable[str] = ()) -> list[Problem]:
        """``n`` distinct problems (by id) for ``seed``, none of whose ids is in ``exclude``."""
        rng = np.random.default_rng(seed)
        seen = set(exclude)
        out: list[Problem] = []
        for _ in range(100 * n + 1000):
            if len(out) == n:
                return out
            problem = self.sample(rng)
            if problem.id not in seen:
                seen.add(problem.id)
                out.append(problem)
        raise ValueError(f"{self} has fewer than {n} distinct problems outside the excluded ones; widen its knobs "
                         "or ask for fewer (num_train, num_test)")

    def split(self, num_train: int, num_test: int, seed: int) -> tuple[list[Problem], list[Problem]]:
        """Disjoint train and held-out test sets, both determined by ``seed``. Made once per process for the
        same arguments: a run's train env and held-out env ask for the same split, and 20,000 problems take
        about a second to draw."""
        train, test = _arith_split(self, num_train, num_test, seed)
        return list(train), list(test)


@functools.lru_cache(maxsize=4)
def _arith_split(arith: Arith, num_train: int, num_test: int, seed: int) -> tuple[tuple[Problem, ...], ...]:
    test = arith.problems(num_test, seed=seed + 1_000_003)
    return tuple(arith.problems(num_train, seed=seed, exclude=(p.id for p in test))), tuple(test)


SlipKind = Literal["result", "operand"]  # which number of a step a slip puts off (solve_steps)
SLIP_KINDS: tuple[SlipKind, ...] = get_args(SlipKind)


def solve_steps(operands: list[int], ops: list[str], error_step: int | None = None, kind: SlipKind = "result",
                offset: int = 0) -> tuple[list[str], int]:
    """Reference steps for ``operands[0] ops[0] operands[1] ...``: one operation per step,
    higher precedence first, then left to right. Returns (steps, the boxed answer).

    With ``error_step``, the steps a solver writes after one slip at that step (the PRM's
    negatives): kind "result" puts that step's result off by ``offset``; "operand" puts its right
    operand off by ``offset`` (the arithmetic is then right for the wrong number). An error at the
    last (answer) step boxes the final value plus ``offset``. Later steps carry the wrong value on.
    """
    if kind not in SLIP_KINDS:
        raise ValueError(f"solve_steps kind={kind!r} must be one of {SLIP_KINDS}")
    values, ops = list(operands), list(ops)
    steps = []
    while ops:
        top = max(PRECEDENCE[op] for op in ops)
        i = next(k for k, op in enumerate(ops) if PRECEDENCE[op] == top)
        erred = len(steps) == error_step
        left, right = values[i], values[i + 1] + (offset if erred and kind == "operand" else 0)
        result = OPERATORS[ops[i]](left, right) + (offset if erred and kind == "result" else 0)
        steps.append(f"{left} {ops[i]} {right} = {result}")
        values[i : i + 2] = [result]
        del ops[i]
    answer = values[0] + (offset if len(steps) == error_step else 0)
    steps.append(f"The answer is \\boxed{{{answer}}}.")
    return steps, answer
