import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.datasets import MATH500, Arith, Problem, load_problems, solve_steps
from envs.prompts import STEP_DELIMITER, split_steps



def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_math500_loads_with_all_fields():
    problems = load_problems(MATH500)
    assert len(problems) == 500
    first = problems[0]
    assert first.id == "test/precalculus/807.json"
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.subject == "Precalculus" and first.level == 2 and first.solution.startswith("We have")
    assert {p.level for p in problems} == {1, 2, 3, 4, 5}


def test_filters_and_limit():
    algebra_l1 = load_problems(MATH500, subjects=["algebra"], levels=[1])
    assert algebra_l1 and all(p.subject == "Algebra" and p.level == 1 for p in algebra_l1)
    assert len(load_problems(MATH500, subjects=["Algebra"], levels=[1], limit=3)) == 3


def test_openr_schema_json_array_and_answer_from_solution(tmp_path):
    openr = write_jsonl(tmp_path / "openr.jsonl", [{"problem": "1+1?", "final_answer": "2", "level": "Level ?"}])
    assert load_problems(openr) == [Problem(id=f"{openr}:1", problem="1+1?", answer="2")]
    array = tmp_path / "data.json"
    array.write_text(json.dumps([{"question": "2+2?", "answer": 4, "id": "q1", "level": 3}]))
    assert load_problems(array) == [Problem(id="q1", problem="2+2?", answer="4", level=3)]
    solution_only = write_jsonl(tmp_path / "sol.jsonl", [{"problem": "p", "solution": "so $\\boxed{\\frac{1}{2}}$."}])
    assert load_problems(solution_only)[0].answer == "\\frac{1}{2}"


def test_directory_with_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}])
    assert [p.problem for p in load_problems(tmp_path, split="train")] == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        load_problems(tmp_path)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"problem": "a", "answer": "1"}', '{"problem": "b", "answer": '], r"bad\.jsonl:2: invalid JSON"),
        (['{"problem": "a", "answer": "1"}', '{"answer": "1"}'],
         r"bad\.jsonl:2: missing field 'problem' or 'question'"),
        (['{"problem": "a"}'], r"bad\.jsonl:1: missing field 'answer' or 'final_answer'"),
        (['{"problem": "", "answer": "1"}'], r"bad\.jsonl:1: field 'problem' must be a non-empty string"),
        (['{"problem": "a", "answer": [1]}'], r"bad\.jsonl:1: field 'answer' must be a string or number"),
        (['{"problem": "a", "answer": "1", "level": "hard"}'], r"bad\.jsonl:1: field 'level'"),
        (['[1, 2]'], r"bad\.jsonl\[0\]: expected a JSON object"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        load_problems(path)


def test_non_utf8_file_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 \(byte 0xe9"):
        load_problems(path)


def test_missing_file_and_empty_filters(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_problems(tmp_path / "nope.jsonl")
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "a", "answer": "1", "subject": "Algebra", "level": 2}])
    with pytest.raises(ValueError,
                       match=r"0 kept by subjects=\['Geometry'\], levels=None; subjects present: \['Algebra'\]"):
        load_problems(path, subjects=["Geometry"])
    with pytest.raises(ValueError, match="limit=0"):
        load_problems(path, limit=0)


def test_hf_scheme_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mathrl\[hf\]'"):
        load_problems("hf://HuggingFaceH4/MATH-500:test")


def check_steps(problem: Problem) -> None:
    """Every step 'a op b = c' is exact, each result feeds a later step, and the box holds the last."""
    steps = split_steps(problem.solution)
    for step in steps[:-1]:
        a, op, b, c = re.fullmatch(r"(-?\d+) ([-+*]) (-?\d+) = (-?\d+)", step).groups()
        assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)
    last_result = steps[-2].split(" = ")[1]
    assert steps[-1] == f"The answer is \\boxed{{{last_result}}}." and problem.answer == last_result


def test_arith_solutions_are_exact_and_deterministic():
    arith = Arith(digits=2, min_ops=1, max_ops=3, operators="+-")
    problems = arith.problems(300, seed=7)
    for problem in problems:
        check_steps(problem)
        numbers = [int(x) for x in re.findall(r"\d+", problem.problem)]
        assert all(10 <= x <= 99 for x in numbers) and 2 <= len(numbers) <= 4
    assert problems == arith.problems(300, seed=7)
    assert problems != arith.problems(300, seed=8)
    assert {p.level for p in problems} == {1, 2, 3}
    assert len({p.id for p in problems}) == 300


def test_arith_precedence_by_hand():
    steps, answer = solve_steps([2, 3, 4, 5], ["+", "*", "-"])
    assert steps == ["3 * 4 = 12", "2 + 12 = 14", "14 - 5 = 9", "The answer is \\boxed{9}."]
    assert answer == 9
    for problem in Arith(digits=1, max_ops=4, operators="+-*").problems(200, seed=0):
        check_steps(problem)
    assert STEP_DELIMITER.join(steps) == "3 * 4 = 12\n\n2 + 12 = 14\n\n14 - 5 = 9\n\nThe answer is \\boxed{9}."


def test_arith_split_is_disjoint_and_knobs_are_checked():
    train, test = Arith().split(2000, 500, seed=3)
    assert len(train) == 2000 and len(test) == 500
    assert not {p.id for p in train} & {p.id for p in test}
    assert test == Arith().problems(500, seed=3 + 1_000_003)  # the test set is drawn first, from its own seed
    train.clear()  # a split is made once per process and each caller gets its own lists
    assert Arith().split(2000, 500, seed=3)[0][:3] == Arith().problems(3, seed=3, exclude=(p.id for p in test))
    for bad in (dict(digits=0), dict(min_ops=3, max_ops=2), dict(operators="/")):
        with pytest.raises(ValueError, match="Arith"):
            Arith(**bad)
    with pytest.raises(ValueError, match="fewer than"):
        Arith(digits=1, min_ops=1, max_ops=1, operators="+").problems(200, seed=0)


def test_arith_sample_uses_given_rng():
    a = Arith().sample(np.random.default_rng(5))
    assert a == Arith().sample(np.random.default_rng(5))
