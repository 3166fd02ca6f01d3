"""envs.grader against hostile model output: code that must never run, numbers and nestings that
must never be computed, sizes and bytes that must never crash or hang. Every call must return
False (or raise a clear TypeError/ValueError) within its timeout + 0.5 s, from any thread."""

import threading
import time

import pytest

from envs.grader import extract_answer, grade_batch, is_equiv, warm_up

TIMEOUT = 1.0
SLACK = 0.5
GOLD = "7"  # no hostile string below equals 7


@pytest.fixture(scope="module", autouse=True)
def workers():
    warm_up()


def code_payloads(canary: str) -> list[str]:
    """Python (and sympy) code that would create the canary file if anything evaluated it."""
    calls = [
        f"__import__('os').system('touch {canary}')",
        f"open('{canary}', 'w').write('x')",
        f"open(\"{canary}\", \"w\")",
        f"exec(\"open('{canary}','w')\")",
        f"eval(\"open('{canary}','w')\")",
        f"(lambda: open('{canary}', 'w'))()",
        f"[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0](['touch', '{canary}'])",
        f"__builtins__.__dict__['open']('{canary}', 'w')",
        f"import os; os.system('touch {canary}')",
        f"sympify(\"open('{canary}','w')\")",
        f"Symbol('x').__class__.__init__.__globals__['os'].system('touch {canary}')",
        f"getattr(__import__('builtins'), 'open')('{canary}', 'w')",
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"\\input{{{canary}}}",
        f"\\immediate\\write18{{touch {canary}}}",
        "{{7*7}}${7*7}%s%n%x",
        f"cos\nsystem\n(S'touch {canary}'\ntR.",
    ]
    wrappers = ["{}", "\\boxed{{{}}}", "${}$", "x = {}", "\\text{{{}}}", "\\frac{{{}}}{{2}}", "({}, 1)", "\\{{{}\\}}"]
    return [wrapper.format(call) for call in calls for wrapper in wrappers]


def number_bombs() -> list[str]:
    return [
        "9^{9^{9^{9}}}", "10^{10^{10}}", "2**2**2**2**2", "2**2**2**2**2**2", "1e999999", "1e-999999", "-1e999999",
        "10^{-10^{10}}", "((10!)!)!", "(10!)!", "1001!", "(-1)!", "(1/2)!", "\\binom{10^{9}}{5}",
        "\\binom{100000}{50000}",
        "\\sqrt[10^{9}]{2}", "\\sqrt[0]{2}", "2^{2^{14}}", "2^{2^{20}}", "(2^{10000})^{10000}", "x^{10^{10}}",
        "e^{e^{e^{e^{e^{10}}}}}", "(x+1)^{10000}", "(x+y+z+1)^{10000}", "\\sum_{k=1}^{10^{10}} k",
        "\\prod_{k=1}^{10^{6}} k", "9" * 401, "9" * 5000, "1." + "0" * 5000 + "1", "1e" + "9" * 50, "0^{-1}",
        "\\frac{1}{0}", "0/0", "\\log 0", "\\infty - \\infty", "\\tan(\\pi/2)", "2^{10000}*2^{10000}*2^{10000}",
        "1.5\\times10^{999999}", "10^{9999}!", "\\sqrt{-1}^{10^{100}}", "11111_{99}", "1" * 2000 + "_2",
        "\\sin(" * 300 + "x" + ")" * 300, "x^{x^{x^{x^{x^{x}}}}}",
    ]


def structure_bombs() -> list[str]:
    depth = 1000
    matrix = "\\begin{pmatrix}" + "\\\\".join(["&".join(["1"] * 40)] * 40) + "\\end{pmatrix}"
    return [
        "{" * depth + "1" + "}" * depth, "(" * depth + "1" + ")" * depth, "[" * depth + "1" + "]" * depth,
        "\\frac{" * depth + "1", "\\frac{1}{" * depth + "2" + "}" * depth, "\\sqrt{" * depth + "2" + "}" * depth,
        "\\sqrt" * depth + "2", "-" * depth + "1", "+-" * depth + "1", "2^" * depth + "2",
        "2^{" * depth + "2" + "}" * depth,
        "\\left(" * 500 + "1", "{" * 5000, "}" * 5000, "(" * 5000, ")" * 5000, "\\boxed{" * depth, "\\text{" * depth,
        "\\begin{pmatrix}" * 300, "\\end{pmatrix}" * 300, matrix, "\\begin{pmatrix}1&2\\\\3\\end{pmatrix}",
        ",".join(["x"] * 64), ",".join(["(1,2)"] * 1000), "\\cup".join(["(0,1)"] * 500), "|" * depth, "^" * depth,
        "_" * depth, "'" * depth, "a_" * 500, "!" * depth, "1" + "!" * depth, "\\\\" * depth, "&" * depth,
        "\\pm" * depth + "1", "x" + "<x" * 500, "=" * depth, "\\{" * depth, "\\}" * depth, "$" * 2001,
        "\\begin{array}{" + "c" * 5000, "\\sum_{" * 300, "\\log_" * 500 + "2",
    ]


def size_and_byte_bombs() -> list[str]:
    big = 100_000
    return [
        "x" * big, "1" * big, "9" * big, " " * big, "\\" * big, "{" * big, "$" * big, "1+" * (big // 2) + "1",
        "\\frac{1}{2}" * (big // 11), "a" * 1999, "x+" * 999 + "x", "(x+1)" * 400, "1," * 999 + "1",
        "\\boxed{" + "1" * big + "}", "The answer is " + "9" * big, "\x00" * 10, "1\x002", "\x00\\boxed{1}",
        "".join(map(chr, range(1, 32))), "\x7f" * 10, "\ud800", "\udfff\ud800", "1\ud8002", "\\frac{\ud800}{2}",
        "\U0001f600" * 100, "\u202e7", "\u200b7\u200b", "7\u0301", "\uff17", "\u0663", "\u00b2", "\u00a0" * 100,
        "\ufeff", "\r\n" * 1000, "\t" * 1000, "\\text{\x00}", "\\begin{pmatrix}\x00\\end{pmatrix}",
    ]


def hostile_strings(canary: str) -> list[str]:
    return code_payloads(canary) + number_bombs() + structure_bombs() + size_and_byte_bombs()


def timed(function, *args):
    start = time.monotonic()
    result = function(*args)
    return result, time.monotonic() - start


@pytest.fixture()
def hostile(tmp_path):
    canary = tmp_path / "CANARY"
    strings = hostile_strings(str(canary))
    yield strings
    assert not canary.exists(), "hostile input ran code: the canary file was created"


def test_there_are_enough_hostile_strings(tmp_path):
    assert len(hostile_strings(str(tmp_path / "CANARY"))) >= 200


def test_is_equiv_on_hostile_preds_and_golds(hostile):
    slow = []
    for text in hostile:
        for pred, gold in ((text, GOLD), (GOLD, text)):
            verdict, seconds = timed(is_equiv, pred, gold, TIMEOUT)
            assert verdict is False, f"{pred[:80]!r} vs {gold[:80]!r} graded {verdict!r}"
            if seconds > TIMEOUT + SLACK:
                slow.append((pred[:60], gold[:60], round(seconds, 2)))
    assert not slow, f"calls over {TIMEOUT + SLACK} s: {slow}"


def test_extract_answer_on_hostile_text(hostile):
    for text in hostile:
        for wrapped in (text, f"\\boxed{{{text}}}", f"The answer is {text}", f"\\fbox{{{text}",
                        f"<answer>{text}</answer>", f"<answer>{text}"):
            answer, seconds = timed(extract_answer, wrapped)
            assert answer is None or isinstance(answer, str)
            assert seconds < TIMEOUT + SLACK, f"extract_answer took {seconds:.2f} s on {wrapped[:60]!r}"


def test_grade_batch_on_hostile_preds(hostile):
    verdicts, seconds = timed(grade_batch, hostile, [GOLD] * len(hostile), TIMEOUT)
    assert verdicts == [False] * len(hostile)
    assert seconds < 30.0, f"grade_batch of {len(hostile)} hostile answers took {seconds:.1f} s"


def test_math_verify_runs_no_hostile_code_and_stays_in_time(tmp_path):
    """math-verify grades in the same bounded workers; the code payloads (it is about 50 answers a second where
    ours is thousands, and each overrun costs a full timeout, so not the whole hostile set here)."""
    pytest.importorskip("math_verify", reason="the math_verify extra: pip install 'mathrl[math-verify]'")
    warm_up(scorers=("math_verify",))
    canary = tmp_path / "CANARY"
    payloads = code_payloads(str(canary))
    verdicts, seconds = timed(grade_batch, payloads, [GOLD] * len(payloads), TIMEOUT, "math_verify")
    assert verdicts == [False] * len(payloads) and not canary.exists()
    assert seconds < len(payloads) * TIMEOUT / 2 + SLACK, f"{len(payloads)} payloads took {seconds:.1f} s"


def test_hostile_calls_from_threads(hostile):
    slow, wrong = [], []

    def grade(texts):
        for text in texts:
            verdict, seconds = timed(is_equiv, text, GOLD, TIMEOUT)
            if verdict is not False:
                wrong.append(text[:60])
            if seconds > TIMEOUT + SLACK:
                slow.append((text[:60], round(seconds, 2)))

    threads = [threading.Thread(target=grade, args=(hostile[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and not slow, f"wrong verdicts: {wrong}; calls over {TIMEOUT + SLACK} s: {slow}"


class Exploding:
    """A caller's object whose str/repr would create the canary: the grader must not call them."""

    def __init__(self, canary):
        self.canary = canary

    def __str__(self):
        self.canary.touch()
        return "7"

    __repr__ = __str__


@pytest.mark.parametrize("bad", [b"7", 7, 7.0, float("nan"), ["7"], {"7": 7}, ("7",)])
def test_non_text_raises_type_error(bad):
    with pytest.raises(TypeError, match="must be a str"):
        is_equiv(bad, GOLD)
    with pytest.raises(TypeError, match="must be a str"):
        is_equiv(GOLD, bad)
    with pytest.raises(TypeError, match="expects a str"):
        extract_answer(bad)


def test_objects_are_not_stringified(tmp_path):
    canary = tmp_path / "CANARY"
    with pytest.raises(TypeError, match="Exploding"):
        is_equiv(Exploding(canary), GOLD)
    with pytest.raises(TypeError, match="Exploding"):
        grade_batch([GOLD], [Exploding(canary)])
    assert not canary.exists()
