"""envs.grader: agreement with public graders' labelled cases, extraction, our own labelled cases
for what that file lacks, batch == per-item, time bounds, threads and fork."""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from envs.datasets import Problem
from envs.grader import extract_answer, grade_batch, is_equiv, math_verify_equiv, strings_equiv, warm_up
from envs.modes import Grader
from envs.rewards import OutcomeReward, StepContext

CASES_PATH = Path(__file__).resolve().parents[2] / "shared/data/grader_cases.jsonl"
MIN_AGREEMENT = 0.97


@pytest.fixture(scope="module", autouse=True)
def workers():
    """Start the pool once, so no test spends its grading timeout on worker start-up."""
    warm_up()


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    if not CASES_PATH.exists():
        pytest.skip(f"labelled grader cases not found at {CASES_PATH} (they live in ../shared/data, outside the repo)")
    return [json.loads(line) for line in CASES_PATH.read_text().splitlines() if line.strip()]


def test_agreement_with_labelled_cases(cases):
    verdicts = [is_equiv(case["pred"], case["gold"]) for case in cases]
    disagreements = [(case["pred"], case["gold"], case["expected"], case["category"])
                     for case, verdict in zip(cases, verdicts) if verdict != case["expected"]]
    agreed = len(cases) - len(disagreements)
    print(f"grader agreement: {agreed}/{len(cases)}")
    assert agreed / len(cases) >= MIN_AGREEMENT, f"{agreed}/{len(cases)} agree; disagreements: {disagreements}"


def test_grade_batch_equals_is_equiv(cases):
    preds, golds = [case["pred"] for case in cases], [case["gold"] for case in cases]
    assert grade_batch(preds, golds) == [is_equiv(pred, gold) for pred, gold in zip(preds, golds)]


@pytest.mark.parametrize("text, answer", [
    ("so the result is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{2}}{\\{2\\}}}", "\\frac{\\sqrt{2}}{\\{2\\}}"),  # nested and escaped braces
    ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{\\boxed{3}}", "3"),
    ("\\fbox{7}", "7"),
    ("hence $\\boxed 5$ apples", "5"),
    ("The answer is: $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("Thus the final answer is 12.", "12"),
    ("The answer is (C).", "(C)"),
    ("no final answer here", None),
    ("\\boxed{1} and an unclosed \\boxed{2", None),  # the last box decides, and it is truncated
    ("\\boxed{}", None),
    ("<answer> 42 </answer>", "42"),  # reasoning-gym's and R1-Zero's format
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<answer>x</answer> \\boxed{3}", "3"),  # a box wins over the tags
    ("<answer> </answer>", None), ("</answer> <answer>", None), ("<answer>5", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_extract_answer_rejects_non_text():
    with pytest.raises(TypeError, match="expects a str"):
        extract_answer(b"\\boxed{1}")


# (pred, gold, expected) for what the labelled file lacks or has only once or twice.
OWN_CASES = [
    # scientific notation
    ("1.5\\times10^{3}", "1500", True), ("1.5\\times10^{3}", "150", False), ("1.5 \\cdot 10^3", "1500", True),
    ("3e5", "300000", True), ("3e5", "30000", False), ("2.5e-3", "0.0025", True),
    ("6.02\\times 10^{23}", "6.02e23", True), ("6.02\\times 10^{23}", "6.02e22", False),
    # degrees
    ("45^\\circ", "45", True), ("45^{\\circ}", "45", True), ("45\u00b0", "45", True), ("72", "72 degrees", True),
    ("30^\\circ", "60", False), ("45^{\\circ}", "54", False),
    # bases
    ("204_5", "54", True), ("204_{5}", "54", True), ("101_2", "5", True), ("101_2", "6", False),
    ("1012_3", "32", True), ("1012_3", "1012", False), ("29_5", "14", False),  # 9 is not a base-5 digit
    # mixed numbers
    ("2\\frac{1}{2}", "2.5", True), ("2\\frac{1}{2}", "\\frac{5}{2}", True), ("-3\\frac{1}{4}", "-3.25", True),
    ("2\\frac{1}{2}", "1", False), ("2\\frac{1}{2}", "2.25", False),
    # percent
    ("50\\%", "0.5", True), ("50\\%", "50", True), ("12.5%", "\\frac{1}{8}", True), ("50\\%", "\\frac{1}{2}", True),
    ("50\\%", "0.05", False), ("50\\%", "5", False),
    # numbers
    ("1000001", "1000000", False), ("0.333", "\\frac13", False), ("1\\,000", "1000", True),
    ("\\$1,000,000", "1000000", True), ("1,000,000", "100000", False),
    # intervals and inequalities
    ("x \\geq 5", "[5, \\infty)", True), ("x > 5", "[5, \\infty)", False), ("-2 < x \\le 3", "(-2, 3]", True),
    ("x \\in [5,\\infty)", "[5,\\infty)", True), ("(1,2)", "[1,2]", False),
    # symbolic
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True), ("e^{i\\pi}", "-1", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\sin^2 x + \\cos^2 x", "1", True), ("\\log_2 8", "3", True), ("\\binom{5}{2}", "10", True), ("5!", "120", True),
    ("\\sqrt[3]{27}", "3", True), ("2i+1", "1+2i", True), ("\\sqrt{8}", "3\\sqrt{2}", False), ("5!", "24", False),
    ("x^2\\frac{1}{2}", "\\frac{x^2}{2}", True), ("3^{9000}", "3^{9000}+1", False), ("2^{18000}", "x", False),
    ("1000!", "n", False), ("(x+1)^{10000}", "(1+x)^{10000}", True),
    # lists, sets, \pm, vectors, text
    ("\\pm 3", "3, -3", True), ("x = \\pm 3", "-3, 3", True), ("1,2", "2,1", True), ("(1,2)", "(2,1)", False),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1,2)", True), ("\\emptyset", "\\{\\}", True),
    ("\\text{Monday}", "monday", True), ("\\textbf{(B)}", "B", True), ("B", "C", False),
    ("\\text{Tuesday}", "Monday", False),
]


@pytest.mark.parametrize("pred, gold, expected", OWN_CASES)
def test_own_labelled_cases(pred, gold, expected):
    assert is_equiv(pred, gold) is expected


def test_none_pred_is_false():
    assert is_equiv(None, "1") is False
    assert grade_batch([None, "1"], ["1", "1"]) == [False, True]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="gold must be a str"):
        is_equiv("1", 1)
    with pytest.raises(TypeError, match="pred must be a str or None"):
        grade_batch([1.0], ["1"])
    with pytest.raises(ValueError, match="2 preds but 1 golds"):
        grade_batch(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="timeout must be > 0"):
        is_equiv("1", "1", timeout=0)


# 64 bracketed powers whose float evaluation overflows: matching them up costs seconds of sympy.
SLOW_PRED = ",".join(f"(x+{k})^{{9999}}" for k in range(1, 65))
SLOW_GOLD = ",".join(f"(x+{k})^{{9999}}+1" for k in range(64, 0, -1))


def test_timeout_is_respected_and_the_worker_replaced():
    start = time.monotonic()
    assert is_equiv(SLOW_PRED, SLOW_GOLD, timeout=0.5) is False
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    assert is_equiv("(x+1)^2", "x^2+2x+1") is True  # the replacement worker answers
    assert time.monotonic() - start < 1.0


def test_grade_batch_bounds_each_item():
    preds = [SLOW_PRED, "x+1", "(x+1)^2", "\\sqrt{4}"]
    golds = [SLOW_GOLD, "1+x", "x^2+2x+1", "3"]
    start = time.monotonic()
    assert grade_batch(preds, golds, timeout=0.5) == [False, True, True, False]
    assert time.monotonic() - start < 1.5


def test_calls_from_threads():
    pairs = [("(x+1)^2", "x^2+2x+1", True), ("\\frac{x}{7}+\\frac{2}{7}", "\\frac{x+2}{7}", True),
             ("x < 5", "x > 5", False), ("1/2", "0.5", True)] * 5
    errors = []

    def grade(pair_slice):
        for pred, gold, expected in pair_slice:
            start = time.monotonic()
            verdict = is_equiv(pred, gold)
            if verdict is not expected or time.monotonic() - start > 1.5:
                errors.append((pred, gold, verdict, time.monotonic() - start))

    threads = [threading.Thread(target=grade, args=(pairs[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_grades_and_leaves_the_parents_workers_alone():
    from envs.grader import workers

    assert is_equiv("x+1", "1+x")
    pid = os.fork()
    if pid == 0:  # child: its own pool; its exit hook must not touch the parent's workers
        verdict = is_equiv("(x+1)^2", "x^2+2x+1", timeout=30.0)
        workers._close_pool_at_exit()
        os._exit(0 if verdict else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    start = time.monotonic()
    assert is_equiv("x^2-1", "(x-1)(x+1)")
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("a, b, same", [
    ("0.5", "\\frac{1}{2}", True), ("\\$1{,}000", "1000", True), ("x = 3", "3", True), ("\\text{(B)}", "B", True),
    ("\\sqrt{4}", "2", False),  # equal only symbolically: the string tier cannot tell
    ("3", "4", False), ("", "3", False), ("9" * 100_000, "9" * 100_000, True),
])
def test_strings_equiv_is_the_string_tier_alone(a, b, same):
    assert strings_equiv(a, b) is same
    if same:
        assert is_equiv(a, b)


def test_strings_equiv_refuses_non_strings():
    with pytest.raises(TypeError, match="a must be a str, got int"):
        strings_equiv(3, "3")
    with pytest.raises(TypeError, match="b must be a str, got NoneType"):
        strings_equiv("3", None)


def test_the_grader_option_names_the_graders():
    assert grade_batch(["1/2"], ["0.5"], grader=Grader.MATHRL) == [True]
    with pytest.raises(ValueError, match="grader='sympy' must be one of"):
        grade_batch(["1"], ["1"], grader="sympy")


MATH_VERIFY_CASES = [("\\frac{1}{2}", "0.5", True), ("\\frac{2}{4}", "\\frac12", True), ("x^2+2x+1", "(x+1)^2", True),
                     ("3", "4", False), (None, "4", False), ("\\{1,2\\}", "\\{2,1\\}", True)]


def test_math_verify_grades_in_the_workers_as_it_grades_in_process():
    """grade_batch(grader="math_verify") is math-verify's own verdict (here run in this process on trusted text),
    through the same bounded workers as ours."""
    pytest.importorskip("math_verify", reason="the math_verify extra: pip install 'mathrl[math-verify]'")
    warm_up(scorers=("math_verify",))
    preds, golds, expected = zip(*MATH_VERIFY_CASES)
    assert grade_batch(preds, golds, timeout=10.0, grader="math_verify") == list(expected)  # a loaded CI core
    assert [pred is not None and math_verify_equiv(pred, gold) for pred, gold, _ in MATH_VERIFY_CASES] == list(expected)
    contexts = [StepContext(Problem(id=str(i), problem="?", answer=gold), (), f"\\boxed{{{pred}}}", done=True)
                for i, (pred, gold, _) in enumerate(MATH_VERIFY_CASES) if pred is not None]
    output = OutcomeReward(grader=Grader.MATH_VERIFY, timeout=10.0).score(contexts)
    assert list(output.rewards) == [float(e) for p, _, e in MATH_VERIFY_CASES if p is not None]
