"""Final-answer extraction and safe, time-bounded equivalence of MATH answers.

``extract_answer`` takes the content of the last ``\\boxed{}``/``\\fbox{}`` (or the text after "The answer
is"); ``is_equiv`` and ``grade_batch`` decide whether a model's answer equals the gold one, in three tiers:
a LaTeX-aware string and number fast path in the caller (``strings_equiv`` alone), a bounded parser that
builds sympy objects in worker processes, and a deadline on every call after which its worker is killed.
Model text is untrusted: nothing here hands it to Python's or sympy's evaluators, and every call returns
within its timeout, from any thread. The same workers run the other scorers (``SCORERS``): math-verify's
equivalence (``grader="math_verify"``) and reasoning-gym's own dataset scorers (``reasoning_gym_scores``),
whose packages their template process imports once. Where public graders disagree: bare comma-separated answers compare
as sets, parenthesised tuples in order; unreduced fractions equal reduced ones; ``10\\%`` equals ``10``
and ``0.1``; ``2\\frac{1}{2}`` is a mixed number; ``3e5`` is 300000.
"""

from __future__ import annotations

import atexit
import cmath
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import NoReturn, Sequence

import sympy

from envs.modes import Grader, member_of

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 2_000  # longer answers are only compared as stripped strings
MAX_DEPTH = 100  # nesting of brackets, groups, unary signs and commands in one answer
MAX_NODES = 1_000  # atoms + operations built for one answer
MAX_ITEMS = 64  # elements of one tuple/set/list, parts of one union
MAX_DIGITS = 400  # digits of one number literal
MAX_DECIMAL_EXPONENT = 400  # |n| in 1.5e{n} and 1.5 \times 10^{n}
MAX_EXPONENT = 10_000  # |n| of a numeric exponent, root index
MAX_INT_BITS = 20_000  # bits of numerator + denominator of any exact number built
MAX_FACTORIAL = 1_000  # largest n in n! and \binom{n}{k}
REL_TOL = 1e-6  # relative tolerance of numeric comparisons
ABS_TOL = 1e-12  # absolute slack of floating-point evaluation, for values that are ~0
WORKER_START_TIMEOUT = 60.0  # seconds the template process may take to start (it imports sympy)
WORKER_MEMORY_BYTES = 2 << 30  # address-space limit of the template and of each worker

# ----------------------------------------------------------------------------------------------
# Extraction

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_ANSWER_IS = re.compile(r"answer\s++is\s*+:?", re.IGNORECASE)
ANSWER_TAGS = ("<answer>", "</answer>")  # DeepSeek-R1-Zero's and reasoning-gym's answer format


def extract_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``/``\\fbox{...}`` (also ``\\boxed 5``); else of the last
    ``<answer>...</answer>``; else what follows the last "answer is" on its line; else None. None too when the
    last box is unclosed. Linear in ``len(text)``."""
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a str, got {_describe(text)}")
    last_box = None
    for last_box in _BOX.finditer(text):
        pass
    if last_box is not None:
        return _box_content(text, last_box.end())
    close = text.rfind(ANSWER_TAGS[1])
    open_ = text.rfind(ANSWER_TAGS[0], 0, close) if close != -1 else -1
    if open_ != -1:
        return text[open_ + len(ANSWER_TAGS[0]):close].strip() or None
    last_phrase = None
    for last_phrase in _ANSWER_IS.finditer(text):
        pass
    if last_phrase is not None:
        return _phrase_answer(text, last_phrase.end())
    return None


def _box_content(text: str, start: int) -> str | None:
    """The argument of a box command whose name ends at ``start``: {...}, or up to "$"/newline."""
    while start < len(text) and text[start] in " \t":
        start += 1
    if not text.startswith("{", start):
        end = min([found for found in (text.find("$", start), text.find("\n", start)) if found != -1],
                  default=len(text))
        return text[start:end].strip().rstrip(".").strip() or None
    end = _closing_brace(text, start)
    if end is None:
        return None
    return text[start + 1:end].strip() or None


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the "}" matching the "{" at ``start`` (escaped braces skipped), or None."""
    depth = 0
    for token in _BRACE_TOKEN.finditer(text, start):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return None


def _phrase_answer(text: str, start: int) -> str | None:
    end = text.find("\n", start)
    answer = text[start:end if end != -1 else len(text)].strip().strip("*").strip()
    if answer.startswith("$"):
        answer = answer.lstrip("$").split("$", 1)[0]
    elif answer.startswith("\\(") and "\\)" in answer:
        answer = answer[2:].split("\\)", 1)[0]
    return answer.strip().rstrip(".").strip() or None


# ----------------------------------------------------------------------------------------------
# Normalisation (string level, linear-time regexes only)

_UNICODE = str.maketrans({
    "\u2212": "-", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u00f7": "\\div ", "\u2264": "\\le ",
    "\u2265": "\\ge ", "\u2260": "\\ne ", "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u00b1": "\\pm ",
    "\u221a": "\\sqrt ", "\u222a": "\\cup ", "\u00b0": "", "\u00a0": " ",
})
_THOUSANDS = re.compile(r"(?<=[0-9])(?:\{,\}|,\\!|\\,)\s*(?=[0-9]{3}(?![0-9]))")
_SIZING = re.compile(r"\\(?:left|right|[bB]igg?[lr]?|displaystyle|textstyle|limits)(?![a-zA-Z])\.?")
_BARS = re.compile(r"\\(?:[lr]?vert|mid)(?![a-zA-Z])")
_SPACING = re.compile(r"(\\\\)|\\[!,;: ]|\\q?quad(?![a-zA-Z])|~|\s+")
_FRAC_ALIASES = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_BINOM_ALIASES = re.compile(r"\\[dt]binom(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])")
_TEXT = re.compile(r"\\(text(?:bf|it|rm|sf|tt|normal|up)?|mbox|hbox|math(?:rm|bf|it|sf|tt|normal)|operatorname"
                   r"|boldsymbol)\s*\{([^{}]*)\}(\^\{?[23]\}?)?")
_TEXT_MODE = frozenset({"text", "textbf", "textit", "textrm", "textsf", "texttt", "textnormal", "textup", "mbox",
                        "hbox"})
_PERCENT = re.compile(r"\\%|%|\bpercent\b", re.IGNORECASE)
_DOLLARS = re.compile(r"\\\$|\$")
_AND = re.compile(r"\band\b")
_RELATION_ALIASES = (
    (re.compile(r"\\(?:geqslant|geq|ge)(?![a-zA-Z])|>="), r"\\ge "),
    (re.compile(r"\\(?:leqslant|leq|le)(?![a-zA-Z])|<="), r"\\le "),
    (re.compile(r"\\(?:neq|ne)(?![a-zA-Z])|!=|\\not\s*="), r"\\ne "),
    (re.compile(r"\\gt(?![a-zA-Z])"), ">"),
    (re.compile(r"\\lt(?![a-zA-Z])"), "<"),
    (re.compile(r"\\ast(?![a-zA-Z])"), "*"),
)
_CHOICE = re.compile(r"\(([A-Za-z])\)")
_UNIT_WORD = r"(?:[a-zA-Z]{3,}+|cm|mm|km|kg|mg|ml|ft|yd|mi|hr|lb|oz)"
_NUMBER_WITH_WORDS = re.compile(rf"([-+]?[0-9][0-9.,/]*+) ?+(?:{_UNIT_WORD} ?+)++")
_COMMA_THOUSANDS = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})++(?:\.[0-9]+)?")
_SPACE_THOUSANDS = re.compile(r"[-+]?[0-9]{1,3}(?: [0-9]{3})++(?:\.[0-9]+)?")
_SPACE = re.compile(r"(\\[a-zA-Z]+) +(?=[a-zA-Z])|([0-9]) +(?=[0-9])| +")
_COMMAS = re.compile(r",(?:,)+")
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _normalize(text: str) -> tuple[str, bool]:
    """(canonical string, whether it had a percent sign). Order matters: thousands separators
    before spacing, text units before unit words, relation aliases before space removal."""
    text = _unwrap(text.strip()).translate(_UNICODE)
    text = _THOUSANDS.sub("", text)
    text = _SIZING.sub("", text)
    text = _BARS.sub("|", text)
    text = _SPACING.sub(lambda match: match.group(1) or " ", text)
    text = _FRAC_ALIASES.sub(r"\\frac", text)
    text = _BINOM_ALIASES.sub(r"\\binom", text)
    text = _DEGREES.sub("", text)
    text = next((part for part in text.split("\\approx") if part.strip()), "")  # "a \\approx 0.58" -> a
    text = _DOLLARS.sub("", text).strip()
    text = _TEXT.sub(_unwrap_text, text)
    text, percents = _PERCENT.subn("", text)
    text = _AND.sub(",", text)
    for pattern, replacement in _RELATION_ALIASES:
        text = pattern.sub(replacement, text)
    text = text.strip().rstrip(".").strip()
    text = _whole_number_forms(text)
    text = _SPACE.sub(_drop_space, text)
    text = _COMMAS.sub(",", text).strip(",")
    choice = _CHOICE.fullmatch(text)
    return choice.group(1) if choice else text, percents > 0


def _drop_space(match: re.Match) -> str:
    """Spaces go, except one after a command followed by a letter ("\\pi r" is not "\\pir") and
    one between digits ("1 2" is not 12)."""
    kept = match.group(1) or match.group(2)
    return kept + " " if kept else ""


def _unwrap(text: str) -> str:
    """Strip whole-answer math delimiters and whole-answer \\boxed{}s (a loop: no recursion)."""
    while True:
        for opener, closer in _WRAPPERS:
            if len(text) > len(opener) + len(closer) and text.startswith(opener) and text.endswith(closer):
                text = text[len(opener):-len(closer)].strip()
                break
        else:
            if not (text.startswith("\\boxed{") and _closing_brace(text, len("\\boxed")) == len(text) - 1):
                return text
            text = text[len("\\boxed{"):-1].strip()


def _unwrap_text(match: re.Match) -> str:
    """\\text{...} and friends: "and" separates answers, trailing text-mode words are units
    (dropped with their ^2), anything else keeps its content."""
    command, content = match.group(1), match.group(2).strip()
    if content in ("and", "or"):
        return ","
    if content in ("%", "\\%", "percent"):
        return "\\%"
    before = match.string[max(0, match.start() - 2):match.start()].strip()
    follows_value = bool(before) and (before[-1].isalnum() or before[-1] in ")]}")
    letters = sum(char.isalpha() for char in content)
    if follows_value and letters and (command in _TEXT_MODE or letters >= 2):
        return " "
    return content + (match.group(3) or "")


def _whole_number_forms(text: str) -> str:
    """Whole-answer number spellings: "64 square feet", "7,425,000", "1 000"."""
    words = _NUMBER_WITH_WORDS.fullmatch(text)
    if words:
        text = words.group(1)
    if _COMMA_THOUSANDS.fullmatch(text):
        return text.replace(",", "")
    if _SPACE_THOUSANDS.fullmatch(text):
        return text.replace(" ", "")
    return text


_PREFIX_NAME = r"(?:[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?'?|\\[a-zA-Z]+|\((?:[a-zA-Z],)+[a-zA-Z]\))"  # x, a_1, \theta, (p,q)
_PREFIX = re.compile(rf"{_PREFIX_NAME}(=|\\in(?![a-zA-Z]))")
_RELATION_MARK = re.compile(r"=|<|>|\\(?:le|ge|ne)(?![a-zA-Z])")


def _split_prefix(text: str) -> tuple[str | None, str]:
    """("x=", rest) for "x=rest" with a lone variable (or tuple of them) and no other relation."""
    match = _PREFIX.match(text)
    if match and not _RELATION_MARK.search(text, match.end()):
        return match.group(), text[match.end():]
    return None, text


def _drop_prefixes(a: str, b: str) -> tuple[str, str]:
    """Drop "x=" / "x\\in" answer prefixes: from both sides when they agree, from one side when the
    other has no relation at all; "\\in" always. "y=-x/2" vs "x+2y=0" stays a pair of equations."""
    prefix_a, rest_a = _split_prefix(a)
    prefix_b, rest_b = _split_prefix(b)
    if prefix_a and (prefix_a.endswith("\\in") or (prefix_a == prefix_b) or not _RELATION_MARK.search(b)):
        a = rest_a
    if prefix_b and (prefix_b.endswith("\\in") or (prefix_a == prefix_b) or not _RELATION_MARK.search(a)):
        b = rest_b
    return a, b


# ----------------------------------------------------------------------------------------------
# Fast path: plain numbers and words, exact fractions, no sympy

_DECIMAL = r"([0-9]+\.?[0-9]*|\.[0-9]+)"
_EXPONENT = r"([-+]?[0-9]{1,4})"
_DIGIT_ARG = r"(?:\{([0-9]+)\}|([0-9]))"
_PLAIN_DECIMAL = re.compile(rf"{_DECIMAL}(?:[eE]{_EXPONENT})?")
_PLAIN_SCIENTIFIC = re.compile(rf"{_DECIMAL}(?:\\times|\\cdot|\*)10\^(?:\{{{_EXPONENT}\}}|{_EXPONENT})")
_PLAIN_FRACTION = re.compile(rf"([0-9]*)\\frac{_DIGIT_ARG}{_DIGIT_ARG}")
_PLAIN_SLASH = re.compile(r"([0-9]+)/([0-9]+)")
_PLAIN_BASE = re.compile(r"([0-9]+)_(?:\{([0-9]+)\}|([0-9]+))")
_WORD = re.compile(r"[A-Za-z]{3,}")


def _plain_number(text: str) -> Fraction | None:
    """The exact value of a plain number spelling (decimal, 3e5, 1.5\\times10^{3}, fractions, mixed
    numbers, 204_5), or None."""
    sign = -1 if text.startswith("-") else 1
    body = text[1:] if text[:1] in "+-" else text
    if len(body) > MAX_DIGITS:
        return None
    if match := _PLAIN_DECIMAL.fullmatch(body):
        value = _scaled(match.group(1), match.group(2))
    elif match := _PLAIN_SCIENTIFIC.fullmatch(body):
        value = _scaled(match.group(1), match.group(2) or match.group(3))
    elif match := _PLAIN_FRACTION.fullmatch(body):
        whole, numerator, denominator = match.group(1), int(match[2] or match[3]), int(match[4] or match[5])
        if denominator == 0 or (whole and not 0 < numerator < denominator):
            return None
        value = int(whole or 0) + Fraction(numerator, denominator)
    elif match := _PLAIN_SLASH.fullmatch(body):
        value = Fraction(int(match[1]), int(match[2])) if int(match[2]) else None
    elif match := _PLAIN_BASE.fullmatch(body):
        value = _from_base(match.group(1), int(match.group(2) or match.group(3)))
    else:
        return None
    return None if value is None else sign * value


def _scaled(mantissa: str, exponent: str | None) -> Fraction | None:
    power = int(exponent or 0)
    return Fraction(mantissa) * Fraction(10) ** power if abs(power) <= MAX_DECIMAL_EXPONENT else None


def _from_base(digits: str, base: int) -> int | None:
    if not 2 <= base <= 36 or any(int(digit, 36) >= base for digit in digits):
        return None
    return int(digits, base)


def _fractions_close(x: Fraction, y: Fraction) -> bool:
    """Integers exactly (1000001 is not 1000000); otherwise within REL_TOL (0.0833333 is 1/12)."""
    if x.denominator == 1 and y.denominator == 1:
        return x == y
    return abs(x - y) <= Fraction(REL_TOL) * max(abs(x), abs(y))


def _numbers_match(x: Fraction, y: Fraction, x_percent: bool, y_percent: bool) -> bool:
    """Equal within REL_TOL; a side written with % may also mean its value / 100."""
    candidates = [(x, y)]
    if x_percent and not y_percent:
        candidates.append((x / 100, y))
    if y_percent and not x_percent:
        candidates.append((x, y / 100))
    return any(_fractions_close(u, v) for u, v in candidates)


def _fast_verdict(pred: str, gold: str) -> bool | None:
    """The verdict when string-level work decides it, else None (needs the symbolic tier)."""
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return pred.strip() == gold.strip()
    (a, a_percent), (b, b_percent) = _normalize(pred), _normalize(gold)
    a, b = _drop_prefixes(a, b)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = _plain_number(a), _plain_number(b)
    if x is not None and y is not None:
        return _numbers_match(x, y, a_percent, b_percent)
    if _WORD.fullmatch(a) or _WORD.fullmatch(b):
        return a.lower() == b.lower()
    return None


# ----------------------------------------------------------------------------------------------
# Safe parser: LaTeX / plain math -> values built from sympy objects


@dataclass(frozen=True)
class _Tuple:
    """(a, b, ...) or an interval such as [0, 1); the brackets are part of the value."""
    items: tuple
    left: str
    right: str


@dataclass(frozen=True)
class _Set:
    """\\{a, b\\}, {a, b}, a bare list a, b or the two values of a \\pm: order and repeats ignored."""
    items: tuple


@dataclass(frozen=True)
class _Union:
    parts: tuple


@dataclass(frozen=True)
class _Matrix:
    rows: tuple


@dataclass(frozen=True)
class _Relation:
    """a < b <= c: ops[i] relates operands[i] and operands[i + 1]; ops from "< <= > >= = !="."""
    ops: tuple
    operands: tuple


_PM = sympy.Symbol("\\pm")  # the sign of a \pm; no parsed name contains a backslash
_MACRO = re.compile(r"\\(?:[a-zA-Z]+|.)", re.DOTALL)
_NUMBER = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?")
_LETTERS = re.compile(r"[a-zA-Z]+")
_GREEK = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau "
    "upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Upsilon Phi Psi Omega".split())
_FUNCTIONS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan, "sinh": sympy.sinh, "cosh": sympy.cosh,
    "tanh": sympy.tanh, "exp": sympy.exp, "log": sympy.log, "ln": sympy.log,
}
_INVERSES = {"sin": "arcsin", "cos": "arccos", "tan": "arctan"}
_ATOM_COMMANDS = frozenset({"\\frac", "\\sqrt", "\\binom", "\\pi", "\\infty", "\\begin", "\\sum", "\\prod",
                            "\\lfloor", "\\lceil"})
_MATRIX_ENVIRONMENTS = frozenset({"matrix", "pmatrix", "bmatrix", "Bmatrix", "vmatrix", "smallmatrix", "array"})
_MINUS_ONE = sympy.Integer(-1)
_CONSTANT_LETTERS = {"e": sympy.E, "i": sympy.I}
_DIGIT_ARGUMENT = re.compile(r" ?(?:\{([0-9]{1,50})\}|([0-9]))")
_SUBSCRIPT_TOKEN = re.compile(r"[0-9]+|[a-zA-Z]")
_RELATION_TOKENS = (("\\le", "<="), ("\\ge", ">="), ("\\ne", "!="), ("<", "<"), (">", ">"), ("=", "="))


# The symbolic tier parses LaTeX or plain math into sympy objects directly (numbers, + - * / ^, implicit
# products, \frac, \sqrt[n]{}, functions, tuples, intervals, sets, unions, matrices, relations, \pm). It
# bounds depth, node count, literal sizes, exponents, factorials and exact integer sizes, so 9^{9^{9^9}} is
# rejected before sympy computes it. Values compare structurally, then by evaluating both sides at three
# fixed pseudo-random points in complex floating point (sympy's big floats where that overflows); never
# with simplify, whose running time has no useful bound. Relations compare as proportional lhs - rhs;
# one-variable inequalities also as intervals. Integers compare exactly, anything else within REL_TOL.

def _parse(text: str):
    """The value of one normalised answer; ValueError when it is not (bounded) math."""
    return _Parser(text).parse()


class _Scanner:
    """The cursor over a normalised answer and the bounds on what is built from it: scanning (``_peek``,
    ``_accept``, ``_expect``) and arithmetic on checked values that fails, naming the position, past
    ``MAX_DEPTH``, ``MAX_NODES``, ``MAX_INT_BITS`` or ``MAX_EXPONENT``. ``_Parser`` adds the grammar."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.depth = 0
        self.nodes = 0
        self.inside_bars = 0
        self.inside_exponent = 0

    # -- scanning
    def _fail(self, problem: str):
        raise ValueError(f"{problem} at position {self.pos} of {self.text!r:.120}")

    def _peek(self) -> str:
        while self.text.startswith(" ", self.pos):
            self.pos += 1
        return self.text[self.pos:self.pos + 1]

    def _peek_macro(self) -> str:
        match = _MACRO.match(self.text, self.pos) if self._peek() == "\\" else None
        return match.group() if match else ""

    def _accept(self, token: str) -> bool:
        self._peek()
        end = self.pos + len(token)
        if not self.text.startswith(token, self.pos):
            return False
        if token[-1].isalpha() and self.text[end:end + 1].isalpha():
            return False  # "\le" must not match "\left"
        self.pos = end
        return True

    def _expect(self, token: str) -> None:
        if not self._accept(token):
            self._fail(f"expected {token!r}")

    def _count(self, value):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self._fail(f"more than {MAX_NODES} nodes")
        if isinstance(value, sympy.Rational) and value.p.bit_length() + value.q.bit_length() > MAX_INT_BITS:
            self._fail(f"a number of more than {MAX_INT_BITS} bits")
        if value in (sympy.zoo, sympy.nan):
            self._fail("an undefined value (division by zero)")
        return value

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self._fail(f"nesting deeper than {MAX_DEPTH}")

    # -- arithmetic on checked values
    def _expr(self, value) -> sympy.Expr:
        if not isinstance(value, sympy.Expr):
            self._fail(f"arithmetic on a {type(value).__name__.strip('_').lower()}")
        return value

    def _add(self, a, b):
        return self._count(self._expr(a) + self._expr(b))

    def _mul(self, a, b):
        return self._count(self._expr(a) * self._expr(b))

    def _div(self, a, b):
        if self._expr(b).is_zero:
            self._fail("division by zero")
        return self._count(self._expr(a) / b)

    def _pow(self, base, exponent):
        base, exponent = self._expr(base), self._expr(exponent)
        if exponent.is_Number:
            if abs(exponent) > MAX_EXPONENT:
                self._fail(f"exponent {exponent} beyond {MAX_EXPONENT}")
            if base.is_Rational and exponent.is_Rational:
                bits = max(base.p.bit_length(), base.q.bit_length()) * abs(exponent.p)
                if bits > MAX_INT_BITS:
                    self._fail(f"a power of about {bits} bits")
        return self._count(sympy.Pow(base, exponent))


class _Parser(_Scanner):
    """Recursive descent over a normalised answer. Grammar, loosest first:
    list: element (',' element)* | element: union (relation union)* | union: sum ('\\cup' sum)*
    sum: term (('+'|'-'|'\\pm') term)* | term: unary (('*'|'/'|implicit) unary)*
    unary: ('-'|'+'|'\\pm') unary | power | power: postfix ('^' unary)? | postfix: atom '!'*
    LaTeX arguments without braces take one character (\\frac94 = 9/4, \\sqrt2)."""

    def parse(self):
        items = self._items(closers=())
        if self._peek():
            self._fail(f"unexpected {self.text[self.pos:self.pos + 10]!r}")
        return items[0] if len(items) == 1 else _Set(tuple(items))

    def _items(self, closers: tuple[str, ...]) -> list:
        items = []
        while True:
            while self._accept(","):
                pass
            if not self._peek() or any(self.text.startswith(closer, self.pos) for closer in closers):
                break
            items.append(self._element())
            if len(items) > MAX_ITEMS:
                self._fail(f"more than {MAX_ITEMS} items")
            if not self._accept(","):
                break
        if not items:
            self._fail("an empty list")
        return items

    def _element(self):
        operands, ops = [self._union()], []
        while op := self._relation():
            ops.append(op)
            operands.append(self._union())
        return _Relation(tuple(ops), tuple(operands)) if ops else operands[0]

    def _relation(self) -> str | None:
        for token, op in _RELATION_TOKENS:
            if self._accept(token):
                return op
        return None

    def _union(self):
        parts = [self._sum()]
        while self._accept("\\cup"):
            parts.append(self._sum())
            if len(parts) > MAX_ITEMS:
                self._fail(f"more than {MAX_ITEMS} parts")
        return _Union(tuple(parts)) if len(parts) > 1 else parts[0]

    def _sum(self):
        value = self._term()
        while True:
            if self._accept("+"):
                value = self._add(value, self._term())
            elif self._accept("-"):
                value = self._add(value, self._mul(_MINUS_ONE, self._term()))
            elif self._accept("\\pm"):
                value = self._add(value, self._mul(_PM, self._term()))
            elif self._accept("\\mp"):
                value = self._add(value, self._mul(-_PM, self._term()))
            else:
                return value

    def _term(self):
        value = self._unary()
        while True:
            if self._peek() == "*" and not self.text.startswith("**", self.pos):
                self.pos += 1
                value = self._mul(value, self._unary())
            elif self._accept("\\cdot") or self._accept("\\times"):
                value = self._mul(value, self._unary())
            elif self._accept("/") or self._accept("\\div"):
                value = self._div(value, self._unary())
            elif self._starts_atom(functions=True):
                value = self._mul(value, self._power())
            else:
                return value

    def _unary(self):
        self._enter()
        try:
            if self._accept("-"):
                return self._mul(_MINUS_ONE, self._unary())
            if self._accept("+"):
                return self._unary()
            if self._accept("\\pm"):
                return self._mul(_PM, self._unary())
            if self._accept("\\mp"):
                return self._mul(-_PM, self._unary())
            return self._power()
        finally:
            self.depth -= 1

    def _power(self):
        base = self._postfix()
        if self._accept("^") or self._accept("**"):
            self.inside_exponent += 1
            exponent = self._unary()
            self.inside_exponent -= 1
            return self._pow(base, exponent)
        return base

    def _postfix(self):
        value = self._atom()
        while self._peek() == "!":
            self.pos += 1
            value = self._factorial(value)
        return value

    def _starts_atom(self, functions: bool) -> bool:
        char = self._peek()
        if not char:
            return False
        if char.isascii() and (char.isalpha() or char in "({"):
            return True  # never a digit: "2 3" and "x 2" are not products
        if char == "|":
            return not self.inside_bars
        macro = self._peek_macro()
        return macro in _ATOM_COMMANDS or macro[1:] in _GREEK or (functions and macro[1:] in _FUNCTIONS)

    def _atom(self):
        self._enter()
        try:
            char = self._peek()
            if char.isascii() and char.isdigit() or char == ".":
                return self._number()
            if char in ("(", "["):
                return self._bracket()
            if char == "{":
                self.pos += 1
                return self._group("}", always_set=False)
            if char == "|" and not self.inside_bars:
                return self._bars()
            if char.isascii() and char.isalpha():
                return self._symbol()
            if char == "\\":
                return self._command()
            self._fail(f"unexpected {char!r}" if char else "a value missing")
        finally:
            self.depth -= 1

    def _number(self):
        match = _NUMBER.match(self.text, self.pos)
        if not match:
            self._fail("a malformed number")
        digits, exponent = match.groups()
        if len(digits) > MAX_DIGITS or (exponent and (len(exponent) > 5 or abs(int(exponent)) > MAX_DECIMAL_EXPONENT)):
            self._fail(f"number {match.group()[:40]!r} is too large")
        self.pos = match.end()
        value = Fraction(match.group())
        if exponent is None and digits.isdigit():
            if self.text.startswith("_", self.pos):
                return self._count(sympy.Integer(self._base_number(digits)))
            mixed = None if self.inside_exponent else self._mixed_fraction()  # x^2\frac12 is x^2/2
            if mixed is not None:
                value += mixed
        return self._count(sympy.Rational(value.numerator, value.denominator))

    def _base_number(self, digits: str) -> int:
        self.pos += 1
        base = self._subscript()
        value = _from_base(digits, int(base)) if base.isdigit() and len(base) <= 2 else None
        if value is None:
            self._fail(f"{digits}_{base} is not a number in a base 2..36")
        return value

    def _mixed_fraction(self) -> Fraction | None:
        """The 1/2 of 2\\frac{1}{2}: a proper fraction of integer literals right after an integer."""
        start = self.pos
        if self._accept("\\frac"):
            numerator, denominator = self._digit_argument(), self._digit_argument()
            if numerator is not None and denominator is not None and 0 < numerator < denominator:
                return Fraction(numerator, denominator)
        self.pos = start
        return None

    def _digit_argument(self) -> int | None:
        match = _DIGIT_ARGUMENT.match(self.text, self.pos)
        if not match:
            return None
        self.pos = match.end()
        return int(match.group(1) or match.group(2))

    def _bracket(self):
        opener = self.text[self.pos]
        self.pos += 1
        items = self._items(closers=(")", "]"))
        closer = self._peek()
        if closer not in (")", "]"):
            self._fail(f"{opener!r} not closed")
        self.pos += 1
        if len(items) == 1:
            if opener + closer not in ("()", "[]"):
                self._fail(f"{opener}{closer} around one value")
            return items[0]
        return _Tuple(tuple(items), opener, closer)

    def _group(self, closer: str, always_set: bool):
        if always_set and self._accept(closer):
            return _Set(())
        items = self._items(closers=(closer,))
        self._expect(closer)
        return items[0] if len(items) == 1 and not always_set else _Set(tuple(items))

    def _bars(self):
        self.pos += 1
        self.inside_bars += 1
        value = self._sum()
        self.inside_bars -= 1
        self._expect("|")
        return self._count(sympy.Abs(self._expr(value)))

    def _symbol(self):
        name = self.text[self.pos]
        self.pos += 1
        if self.text.startswith("_", self.pos):
            self.pos += 1
            return self._count(sympy.Symbol(f"{name}_{self._subscript()}"))
        while self.text.startswith("'", self.pos):
            name += "'"
            self.pos += 1
        return self._letter(name)

    def _letter(self, name: str):
        """A one-letter symbol; e and i are Euler's number and the imaginary unit."""
        if name in _CONSTANT_LETTERS:
            return _CONSTANT_LETTERS[name]
        return self._count(sympy.Symbol(name))

    def _subscript(self) -> str:
        """The raw text of a subscript: {...} (balanced, spaces dropped), a digit run or one char."""
        if self.text.startswith("{", self.pos):
            end = _closing_brace(self.text, self.pos)
            if end is None:
                self._fail("an unclosed subscript")
            raw, self.pos = self.text[self.pos + 1:end], end + 1
            return raw.replace(" ", "")
        match = _SUBSCRIPT_TOKEN.match(self.text, self.pos)
        if not match:
            self._fail("an empty subscript")
        self.pos = match.end()
        return match.group()

    def _argument(self):
        """One LaTeX argument: {group}, or a single digit, letter or command."""
        char = self._peek()
        if char == "{":
            self.pos += 1
            return self._expr(self._group("}", always_set=False))
        if char.isascii() and char.isdigit():
            self.pos += 1
            return self._count(sympy.Integer(int(char)))
        if char.isascii() and char.isalpha():
            self.pos += 1
            return self._letter(char)
        if char == "\\":
            return self._expr(self._command())
        self._fail("a missing argument")

    def _command(self):
        macro = self._peek_macro()
        self.pos += len(macro)
        name = macro[1:]
        if macro == "\\frac":
            return self._div(self._argument(), self._argument())
        if macro == "\\sqrt":
            return self._root()
        if macro == "\\binom":
            return self._binomial(self._argument(), self._argument())
        if macro == "\\pi":
            return sympy.pi
        if macro == "\\infty":
            return sympy.oo
        if macro == "\\{":
            return self._group("\\}", always_set=True)
        if macro in ("\\emptyset", "\\varnothing"):
            return _Set(())
        if macro == "\\begin":
            return self._matrix()
        if macro in ("\\sum", "\\prod"):
            return self._big_operator(sympy.Sum if macro == "\\sum" else sympy.Product)
        if macro in ("\\lfloor", "\\lceil"):
            value = self._sum()
            self._expect("\\rfloor" if macro == "\\lfloor" else "\\rceil")
            return self._count((sympy.floor if macro == "\\lfloor" else sympy.ceiling)(self._expr(value)))
        if name in _GREEK:
            return self._count(sympy.Symbol(name))
        if name in _FUNCTIONS:
            return self._function(name)
        self._fail(f"unsupported command {macro!r}")

    def _root(self):
        index = sympy.Integer(2)
        if self._accept("["):
            index = self._expr(self._sum())
            self._expect("]")
        return self._pow(self._argument(), self._div(sympy.Integer(1), index))

    def _binomial(self, n, k):
        if any(x.is_Number and abs(x) > MAX_FACTORIAL for x in (n, k)):
            self._fail(f"\\binom{{{n}}}{{{k}}} beyond {MAX_FACTORIAL}")
        return self._count(sympy.binomial(n, k))

    def _factorial(self, value):
        value = self._expr(value)
        if value.is_Number and not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
            self._fail(f"factorial of {value} (allowed: integers 0..{MAX_FACTORIAL})")
        return self._count(sympy.factorial(value))

    def _function(self, name: str):
        power = None
        if self._accept("^"):
            power = self._expr(self._unary())
            if power == -1 and name in _INVERSES:
                name, power = _INVERSES[name], None
        base = self._argument() if name == "log" and self._accept("_") else None
        if self._peek() in ("(", "{"):
            argument = self._expr(self._atom())
        else:
            argument = self._power()
            while self._starts_atom(functions=False):
                argument = self._mul(argument, self._power())
        value = self._count(_FUNCTIONS[name](self._expr(argument), *([base] if base is not None else [])))
        return self._pow(value, power) if power is not None else value

    def _big_operator(self, kind):
        self._expect("_")
        self._expect("{")
        variable = self._symbol()
        self._expect("=")
        lower = self._expr(self._sum())
        self._expect("}")
        self._expect("^")
        upper = self._argument()
        body = self._expr(self._term())
        if not isinstance(variable, sympy.Symbol):
            self._fail(f"index {variable} of a sum")
        return self._count(kind(body, (variable, lower, upper)))

    def _matrix(self):
        self._expect("{")
        environment = _LETTERS.match(self.text, self.pos)
        if not environment or environment.group() not in _MATRIX_ENVIRONMENTS:
            self._fail("an unsupported environment")
        self.pos = environment.end()
        self._expect("}")
        if environment.group() == "array" and self._accept("{"):
            spec_end = self.text.find("}", self.pos)
            if spec_end == -1:
                self._fail("an unclosed array column spec")
            self.pos = spec_end + 1
        end = f"\\end{{{environment.group()}}}"
        rows, row, cells = [], [], 0
        while not self._accept(end):
            row.append(self._element())
            cells += 1
            if cells > MAX_NODES:
                self._fail("too many matrix cells")
            if self._accept("&"):
                continue
            rows.append(tuple(row))
            row = []
            if not self._accept("\\\\") and not self.text.startswith(end, self.pos):
                self._fail("expected '&', '\\\\' or the end of the matrix")
        if row:
            rows.append(tuple(row))
        if not rows or len({len(r) for r in rows}) != 1:
            self._fail("a ragged or empty matrix")
        return _Matrix(tuple(rows))


# ----------------------------------------------------------------------------------------------
# Comparison of parsed values


def _symbolic_verdict(pred: str, gold: str) -> bool:
    """The full verdict, sympy included; may be slow, so it runs in a worker process."""
    fast = _fast_verdict(pred, gold)
    if fast is not None:
        return fast
    (a, a_percent), (b, b_percent) = _normalize(pred), _normalize(gold)
    a, b = _drop_prefixes(a, b)
    x, y = _parse(a), _parse(b)
    if _same(x, y):
        return True
    if a_percent != b_percent and isinstance(x, sympy.Expr) and isinstance(y, sympy.Expr):
        return _same(x / 100, y) if a_percent else _same(x, y / 100)
    return False


def _same(a, b) -> bool:
    a, b = _expand_pm(a), _expand_pm(b)
    if isinstance(a, _Relation) or isinstance(b, _Relation):
        return _same_with_relation(a, b)
    if isinstance(a, _Set) or isinstance(b, _Set):
        return _same_items(_items_of(a), _items_of(b))
    if isinstance(a, _Union) or isinstance(b, _Union):
        return _same_items(_parts_of(a), _parts_of(b))
    if isinstance(a, _Matrix) or isinstance(b, _Matrix):
        return _same_matrix(a, b)
    if isinstance(a, _Tuple) and isinstance(b, _Tuple):
        return ((a.left, a.right) == (b.left, b.right) and len(a.items) == len(b.items)
                and all(_same(x, y) for x, y in zip(a.items, b.items)))
    if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr):
        return _exprs_equal(a, b)
    return False


def _expand_pm(value):
    """a \\pm b -> the set {a + b, a - b}; sets absorb the expansions of their items."""
    if isinstance(value, sympy.Expr) and value.has(_PM):
        return _Set((value.xreplace({_PM: 1}), value.xreplace({_PM: -1})))
    if isinstance(value, _Set):
        items = []
        for item in value.items:
            item = _expand_pm(item)
            items.extend(item.items if isinstance(item, _Set) else [item])
        return _Set(tuple(items))
    return value


def _items_of(value) -> tuple:
    return value.items if isinstance(value, _Set) else (value,)


def _parts_of(value) -> tuple:
    return value.parts if isinstance(value, _Union) else (value,)


def _same_items(xs: tuple, ys: tuple) -> bool:
    """Equal as sets: every item has an equal partner on the other side (identical ones first)."""
    return (all(x in ys or any(_same(x, y) for y in ys) for x in xs)
            and all(y in xs or any(_same(x, y) for x in xs) for y in ys))


def _same_matrix(a, b) -> bool:
    """Matrices cell by cell; a row or column vector also equals a tuple (a, b, c)."""
    if isinstance(a, _Tuple):
        a, b = b, a
    if isinstance(b, _Tuple):
        cells = [cell for row in a.rows for cell in row]
        vector = len(a.rows) == 1 or all(len(row) == 1 for row in a.rows)
        return vector and b.left == "(" and len(cells) == len(b.items) and all(map(_same, cells, b.items))
    if not isinstance(a, _Matrix) or not isinstance(b, _Matrix):
        return False
    shape = [len(row) for row in a.rows] == [len(row) for row in b.rows]
    return shape and all(_same(x, y) for row_a, row_b in zip(a.rows, b.rows) for x, y in zip(row_a, row_b))


_FLIPPED = {">": "<", ">=": "<="}


def _ascending(relation: _Relation) -> _Relation:
    """b > a -> a < b, so that equal relations line up operand by operand."""
    if all(op in _FLIPPED for op in relation.ops):
        return _Relation(tuple(_FLIPPED[op] for op in reversed(relation.ops)), tuple(reversed(relation.operands)))
    return relation


def _same_with_relation(a, b) -> bool:
    if isinstance(a, _Relation) and isinstance(b, _Relation):
        return _relations_equal(_ascending(a), _ascending(b))
    relation, other = (a, b) if isinstance(a, _Relation) else (b, a)
    relation = _ascending(relation)
    if relation.ops == ("=",) and isinstance(relation.operands[0], sympy.Symbol):
        return _same(relation.operands[1], other)  # x = 5 vs 5
    interval = _as_interval(relation)
    return interval is not None and _same(interval, other)


def _relations_equal(a: _Relation, b: _Relation) -> bool:
    if a.ops != b.ops or len(a.operands) != len(b.operands):
        return False
    if all(_same(x, y) for x, y in zip(a.operands, b.operands)):
        return True
    if len(a.ops) == 1 and all(isinstance(x, sympy.Expr) for x in a.operands + b.operands):
        difference_a, difference_b = a.operands[0] - a.operands[1], b.operands[0] - b.operands[1]
        return _proportional(difference_a, difference_b, positive=a.ops[0] in ("<", "<="))
    return False


def _as_interval(relation: _Relation):
    """x < 3 -> (-oo, 3); 1 <= x < 2 -> [1, 2); x != 0 -> (-oo, 0) U (0, oo); else None."""
    ops, operands = relation.ops, relation.operands
    if not all(isinstance(x, sympy.Expr) for x in operands):
        return None
    lone = [isinstance(x, sympy.Symbol) for x in operands]
    constant = [not x.free_symbols for x in operands]
    left = {"<": "(", "<=": "["}
    right = {"<": ")", "<=": "]"}
    if len(ops) == 1 and ops[0] in left and lone[0] and constant[1]:
        return _Tuple((-sympy.oo, operands[1]), "(", right[ops[0]])
    if len(ops) == 1 and ops[0] in left and lone[1] and constant[0]:
        return _Tuple((operands[0], sympy.oo), left[ops[0]], ")")
    if len(ops) == 2 and all(op in left for op in ops) and lone[1] and constant[0] and constant[2]:
        return _Tuple((operands[0], operands[2]), left[ops[0]], right[ops[1]])
    if ops == ("!=",) and lone[0] and constant[1]:
        return _Union((_Tuple((-sympy.oo, operands[1]), "(", ")"), _Tuple((operands[1], sympy.oo), "(", ")")))
    return None


def _exprs_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Structurally equal, else equal at every sample point where both evaluate in floating point;
    where none does (overflow, say 3^{9000}), in sympy's arbitrary-exponent floats instead."""
    if a == b:
        return True
    if a.is_Integer and b.is_Integer or a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
        return False  # unequal integers stay unequal however close (3^{9000} + 1); infinities only match exactly
    points = _sample_points(a.free_symbols | b.free_symbols)
    for evaluate in (_evaluate_float, _evaluate_big):
        verdicts = []
        for values, index in points:
            try:
                verdicts.append(_close(evaluate(a, values, index), evaluate(b, values, index)))
            except (ArithmeticError, ValueError, TypeError):
                continue
        if verdicts:
            return all(verdicts)
    return False


def _proportional(u: sympy.Expr, v: sympy.Expr, positive: bool) -> bool:
    """u = c * v for one constant c (c > 0 when ``positive``), judged at the sample points."""
    symbols = u.free_symbols | v.free_symbols
    if not symbols:
        return False
    ratios = []
    for point in _sample_points(symbols):
        try:
            x, y = _evaluate_float(u, *point), _evaluate_float(v, *point)
        except (ArithmeticError, ValueError, TypeError):
            continue
        if abs(x) <= ABS_TOL or abs(y) <= ABS_TOL:
            if abs(x) > ABS_TOL or abs(y) > ABS_TOL:
                return False
            continue
        ratios.append(x / y)
    if not ratios or abs(ratios[0].imag) > REL_TOL * abs(ratios[0]) or (positive and ratios[0].real <= 0):
        return False
    return all(_close(ratio, ratios[0]) for ratio in ratios)


def _close(u, v) -> bool:
    """u ~ v for Python complex numbers or sympy numbers (from ``_evaluate_big``)."""
    return u == v or abs(u - v) <= REL_TOL * max(abs(u), abs(v)) + ABS_TOL


def _unit_hash(text: str) -> float:
    """A deterministic number in [0, 1) from text (same in every process, unlike hash())."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def _sample_points(symbols) -> list[tuple[dict, int]]:
    """(values, index) of three assignments of values in [0.5, 2.5) to the symbols (one when there
    are none); values are hashed from the names so both sides and every run agree."""
    count = 3 if symbols else 1
    return [({s: 0.5 + 2 * _unit_hash(f"{s.name}#{k}") for s in symbols}, k) for k in range(count)]


def _real(z: complex) -> float:
    if abs(z.imag) > ABS_TOL:
        raise ValueError(f"floor/ceiling of the complex number {z}")
    return z.real


_NUMERIC_FUNCTIONS = {
    sympy.sin: cmath.sin, sympy.cos: cmath.cos, sympy.tan: cmath.tan, sympy.asin: cmath.asin,
    sympy.acos: cmath.acos, sympy.atan: cmath.atan, sympy.sinh: cmath.sinh, sympy.cosh: cmath.cosh,
    sympy.tanh: cmath.tanh, sympy.exp: cmath.exp, sympy.log: cmath.log, sympy.Abs: abs,
    sympy.cot: lambda z: 1 / cmath.tan(z), sympy.sec: lambda z: 1 / cmath.cos(z),
    sympy.csc: lambda z: 1 / cmath.sin(z),
    sympy.floor: lambda z: math.floor(_real(z)), sympy.ceiling: lambda z: math.ceil(_real(z)),
}


def _evaluate_float(expr: sympy.Expr, values: dict, index: int) -> complex:
    """``_evaluate``, where inf and nan (complex(2^{18000}) is inf) count as not evaluable."""
    value = _evaluate(expr, values, index)
    if not cmath.isfinite(value):
        raise OverflowError(f"{expr} is not finite in floating point at the sample point")
    return value


def _evaluate(expr: sympy.Expr, values: dict, index: int) -> complex:
    """expr in complex floating point with symbols at ``values``. Sums, undefined functions and the
    like are opaque atoms valued by a hash of their structure and ``index``: equal atoms agree."""
    if expr.is_Symbol:
        return values[expr]
    if expr.is_Number or expr.is_NumberSymbol or expr is sympy.I:
        return complex(expr)
    if expr.is_Add:
        return sum((_evaluate(arg, values, index) for arg in expr.args), 0j)
    if expr.is_Mul:
        product = 1 + 0j
        for arg in expr.args:
            product *= _evaluate(arg, values, index)
        return product
    if expr.is_Pow:
        return _evaluate(expr.base, values, index) ** _evaluate(expr.exp, values, index)
    function = _NUMERIC_FUNCTIONS.get(expr.func)
    if function is not None and len(expr.args) == 1:
        return complex(function(_evaluate(expr.args[0], values, index)))
    return complex(0.5 + _unit_hash(f"{sympy.srepr(expr)}#{index}"))


def _evaluate_big(expr: sympy.Expr, values: dict, index: int) -> sympy.Expr:
    """Like ``_evaluate_float`` but in sympy's floats, whose exponents do not overflow (``index``
    is unused: opaque atoms are valued in ``_evaluate``)."""
    value = sympy.N(expr.xreplace({s: sympy.Float(v) for s, v in values.items()}), 20)
    if not value.is_number or value.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        raise ValueError(f"{expr} has no finite value at the sample point")
    return value


# ----------------------------------------------------------------------------------------------
# Other scorers: math-verify's equivalence and reasoning-gym's own, in the same bounded workers

EXTRAS = {"math_verify": "math-verify", "reasoning_gym": "rg"}  # scorer -> the mathrl extra that installs it


def math_verify_equiv(pred: str, gold: str) -> bool:
    """math-verify's verdict on the answer ``pred`` against the reference ``gold``, each parsed inside
    ``\\boxed{}`` as LaTeX alone (TRL's ``accuracy_reward`` parses a completion so: its plain-expression parser
    would hand the text to sympy's ``parse_expr``, an ``eval``), as ``verify(gold, target)`` takes them. It
    builds sympy objects from model text: it runs in the grading workers (``grade_batch(...,
    grader="math_verify")``), never in the caller's process."""
    from math_verify import LatexExtractionConfig, parse, verify

    latex = [LatexExtractionConfig()]
    return bool(verify(parse(f"\\boxed{{{gold}}}", extraction_config=latex),
                       parse(f"\\boxed{{{pred}}}", extraction_config=latex)))


@functools.lru_cache(maxsize=16)
def _reasoning_gym_dataset(name: str, config: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config))


def reasoning_gym_score(answer: str, source: str) -> float:
    """reasoning-gym's own score in [0, 1] of ``answer`` to the problem ``source`` names (JSON
    ``{"name", "config", "index"}``: entry ``index`` of ``create_dataset(name, **config)``, regenerated here,
    since its generators are seeded per index), by that dataset's ``score_answer``. Runs in the grading
    workers (``reasoning_gym_scores``): a scorer may parse the answer with sympy."""
    spec = json.loads(source)
    dataset = _reasoning_gym_dataset(spec["name"], json.dumps(spec["config"], sort_keys=True))
    return float(dataset.score_answer(answer, dataset[spec["index"]]))


SCORERS = {Grader.MATHRL: lambda pred, gold: _symbolic_verdict(pred, gold), Grader.MATH_VERIFY: math_verify_equiv,
           "reasoning_gym": reasoning_gym_score}
"""What a worker runs for a request [name, *arguments]; a score in [0, 1] (a verdict: 1.0 or 0.0)."""


def scorer_packages(scorer: str) -> frozenset[str]:
    """The package the workers must import ahead for ``scorer`` (a key of ``SCORERS``): an ImportError naming
    the extra that installs it when this interpreter lacks it (a worker would only score 0)."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer {scorer!r} must be one of {sorted(map(str, SCORERS))}")
    if scorer == Grader.MATHRL:
        return frozenset()
    package = str(scorer)
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"the {package!r} scorer needs the {package} package: "
                          f"pip install 'mathrl[{EXTRAS[package]}]'")
    return frozenset({package})


# ----------------------------------------------------------------------------------------------
# Worker processes
#
# min(2, cpu_count) persistent workers, forked on request by a template process: a fresh interpreter
# (started with subprocess, so nothing of the caller, its threads or torch, is forked) that imports sympy
# once and runs no threads, so forking it is safe and a replacement is ready in milliseconds. Not
# multiprocessing.Process: its atexit hook in a forked child would terminate the parent's workers. A caller
# waits for a verdict until its deadline, then has that worker killed, a replacement forked, and returns
# False. Workers start lazily (warm_up() starts them ahead), are reused, run under a memory limit and are
# killed at exit; a forked child of the caller starts its own pool.

_READY = b"ready"
_TEMPLATE_MAIN = ("import sys, runpy; runpy.run_path(sys.argv[1], run_name='mathrl_grader_template')"
                  "['_serve_template'](int(sys.argv[2]), sys.argv[3:])")
_CHANNEL_TIMEOUT = 10.0  # seconds the template may take to fork or kill a worker


def _serve_template(fd: int, preload: Sequence[str] = ()) -> None:
    """The template process: loads sympy (and the packages ``preload`` names: the external graders') once,
    then forks a worker per b"fork" request (which carries the worker's socket) and kills and reaps one per
    b"kill PID". It runs no threads, so forking it is safe, and a replacement worker is ready in milliseconds."""
    _limit_memory()
    _symbolic_verdict("x+1", "1+x")  # import sympy's lazily loaded parts once, for every worker
    for name in preload:
        importlib.import_module(name)
    if "math_verify" in preload:
        math_verify_equiv("x+1", "1+x")  # its LaTeX parser builds itself on a first call
    channel = socket.socket(fileno=fd)
    channel.send(_READY)
    workers: set[int] = set()
    while True:
        message, fds, _, _ = socket.recv_fds(channel, 64, 1)
        if not message:
            return  # the grading process has gone
        if message == b"fork" and fds:
            pid = os.fork()
            if pid == 0:
                channel.close()
                _serve_worker(fds[0])
            os.close(fds[0])
            workers.add(pid)
            channel.send(str(pid).encode())
        elif message.startswith(b"kill "):
            pid = int(message[len(b"kill "):])
            if pid in workers:  # only our own, unreaped children: their pids cannot have been reused
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                workers.discard(pid)
            channel.send(b"killed")


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError) as error:
        log.warning("grading workers run without a memory limit: %s", error)


def _serve_worker(fd: int) -> NoReturn:
    """A forked worker: a score per JSON [scorer, *arguments] request (``SCORERS``), sent back as its JSON
    number, until EOF, then exit."""
    connection = Connection(fd)
    try:
        while True:
            scorer, *arguments = json.loads(connection.recv_bytes())
            connection.send_bytes(json.dumps(_guarded_score(scorer, arguments)).encode())
    except (EOFError, OSError):
        os._exit(0)  # the grading process closed our socket
    except BaseException:  # noqa: BLE001 - never return into the template's loop
        os._exit(1)


def _guarded_score(scorer: str, arguments: list) -> float:
    try:
        return float(SCORERS[scorer](*arguments))
    except Exception:  # noqa: BLE001 - any failure (bounds, sympy, recursion, memory) means "not shown equal"
        return 0.0


class _Template:
    """The template subprocess (a fresh interpreter: nothing of this process is forked) and the
    channel on which this process asks it for workers."""

    def __init__(self, preload: Sequence[str] = ()):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _TEMPLATE_MAIN, str(Path(__file__).resolve()), str(theirs.fileno()),
                 *preload],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        self.channel = ours
        self.lock = threading.Lock()
        try:
            self.channel.settimeout(WORKER_START_TIMEOUT)
            if self.channel.recv(16) != _READY:
                raise OSError(f"grading template pid {self.process.pid} exited with {self.process.poll()}")
            self.channel.settimeout(_CHANNEL_TIMEOUT)
        except OSError:
            self.close()
            raise

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self) -> _Worker:
        ours, theirs = socket.socketpair()
        with theirs, self.lock:
            socket.send_fds(self.channel, [b"fork"], [theirs.fileno()])
            reply = self.channel.recv(32)
        if not reply.isdigit():
            ours.close()
            raise OSError(f"grading template pid {self.process.pid} did not fork a worker (reply {reply!r})")
        return _Worker(int(reply), Connection(ours.detach()), self)

    def kill(self, pid: int) -> None:
        with self.lock:
            self.channel.send(f"kill {pid}".encode())
            self.channel.recv(16)

    def close(self) -> None:
        self.process.kill()
        self.channel.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            log.warning("grading template pid %d did not exit after SIGKILL", self.process.pid)


@dataclass(eq=False)
class _Worker:
    """One forked grading process and this process's end of its socket."""
    pid: int
    connection: Connection
    template: _Template

    def kill(self) -> None:
        self.connection.close()
        try:
            self.template.kill(self.pid)
        except OSError as error:  # the template is gone; the worker exits at its next read (EOF)
            log.warning("could not kill grading worker pid %d: %s", self.pid, error)


class _Pool:
    """Up to ``size`` workers shared by every thread of the process that created it, their template having
    imported the packages ``preload`` names."""

    def __init__(self, size: int, preload: frozenset[str] = frozenset()):
        self.size = size
        self.preload = preload
        self.owner = os.getpid()
        self.changed = threading.Condition()
        self.idle: list[_Worker] = []
        self.workers: set[_Worker] = set()
        self.live = 0  # started + starting
        self.started = False  # a first worker has been ready
        self.closed = False
        self.template: _Template | None = None
        self.template_lock = threading.Lock()

    def _fill(self) -> None:
        """Start workers in the background until ``size`` are live (call with ``changed`` held)."""
        while self.live < self.size and not self.closed:
            self.live += 1
            threading.Thread(target=self._start_worker, name="grader-worker-start", daemon=True).start()

    def _fork_worker(self) -> _Worker:
        with self.template_lock:
            if self.template is None or not self.template.alive():
                self.template = _Template(sorted(self.preload))
            return self.template.fork()

    def _start_worker(self) -> None:
        try:
            worker = self._fork_worker()
        except OSError as error:
            log.warning("could not start a grading worker: %s", error)
            with self.changed:
                self.live -= 1
                self.changed.notify_all()
            return
        with self.changed:
            if self.closed:
                worker.kill()
                return
            self.workers.add(worker)
            self.idle.append(worker)
            self.started = True
            self.changed.notify_all()

    def wait_started(self, timeout: float) -> None:
        """Wait (once per pool) until its first worker is ready: the one-time start-up."""
        with self.changed:
            self._fill()
            self.changed.wait_for(lambda: self.started or self.closed, timeout)

    def forget(self) -> None:
        """In a forked child: close our copies of the parent's sockets, so that the parent's
        workers still see EOF when the parent exits; kill nothing."""
        for worker in list(self.workers):
            worker.connection.close()
        if self.template is not None:
            self.template.channel.close()

    def take(self, count: int, deadline: float) -> list[_Worker]:
        """Up to ``count`` idle workers, waiting until ``deadline`` for at least one."""
        with self.changed:
            self._fill()
            while not self.idle:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    return []
                self.changed.wait(remaining)
            taken, self.idle = self.idle[:count], self.idle[count:]
            return taken

    def give_back(self, workers: list[_Worker]) -> None:
        with self.changed:
            self.idle.extend(workers)
            self.changed.notify_all()

    def discard(self, worker: _Worker) -> None:
        """Kill a worker that overran or broke, and start its replacement."""
        worker.kill()
        with self.changed:
            self.workers.discard(worker)
            self.live -= 1
            self._fill()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            workers, self.workers, self.idle = list(self.workers), set(), []
        for worker in workers:
            worker.kill()
        with self.template_lock:
            if self.template is not None:
                self.template.close()

    def grade(self, items: list[list], timeout: float, deadline: float | None = None) -> list[float]:
        """Scores of ``items`` (each [scorer, *arguments], see ``SCORERS``) spread over the workers; each item
        gets ``timeout`` seconds from when it is sent (and none past ``deadline``); an overrun scores 0 and
        costs its worker."""
        verdicts = [0.0] * len(items)
        todo = deque(range(len(items)))
        running: dict[Connection, tuple[_Worker, int, float]] = {}
        held: list[_Worker] = []
        try:
            while todo or running:
                now = time.monotonic()
                if todo and not held:
                    wait_until = now + timeout if not running else now
                    held = self.take(min(len(todo), self.size), min(wait_until, deadline or wait_until))
                    if not held and not running:
                        break  # no worker came free in time: the rest stay False
                while todo and held:
                    worker, index = held.pop(), todo.popleft()
                    try:
                        worker.connection.send_bytes(json.dumps(items[index]).encode())
                    except OSError:
                        self.discard(worker)
                        continue
                    running[worker.connection] = (worker, index, min(now + timeout, deadline or math.inf))
                if not running:
                    continue
                first_deadline = min(item_deadline for _, _, item_deadline in running.values())
                for connection in wait(list(running), timeout=max(0.0, first_deadline - time.monotonic())):
                    worker, index, _ = running.pop(connection)
                    try:
                        verdicts[index] = float(json.loads(connection.recv_bytes()))
                        held.append(worker)
                    except (EOFError, OSError):
                        self.discard(worker)
                now = time.monotonic()
                for connection, (worker, index, item_deadline) in list(running.items()):
                    if item_deadline <= now:
                        del running[connection]
                        self.discard(worker)
        finally:
            for worker, _, _ in running.values():
                self.discard(worker)  # its answer would arrive out of turn
            self.give_back(held)
        return verdicts


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool(size: int | None = None, preload: frozenset[str] = frozenset()) -> _Pool:
    """This process's pool (a new one after fork, when ``size`` changes or when its template lacks a package
    that ``preload`` names; the new one preloads the old one's too)."""
    global _pool
    with _pool_lock:
        if (_pool is None or _pool.owner != os.getpid() or (size is not None and size != _pool.size)
                or not preload <= _pool.preload):
            kept = frozenset()
            if _pool is not None and _pool.owner == os.getpid():
                kept = _pool.preload
                _pool.close()
            _pool = _Pool(size or min(2, os.cpu_count() or 1), preload | kept)
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    if _pool is not None:
        _pool.forget()
    _pool, _pool_lock = None, threading.Lock()


def _close_pool_at_exit() -> None:
    if _pool is not None and _pool.owner == os.getpid():
        _pool.close()


os.register_at_fork(after_in_child=_forget_pool_after_fork)
atexit.register(_close_pool_at_exit)


# ----------------------------------------------------------------------------------------------
# Public API


def _describe(value) -> str:
    """Type and value for error messages; repr only of plain scalars (any other repr may be code)."""
    if isinstance(value, (bytes, int, float, complex)):
        return f"{type(value).__name__} {value!r:.80}"
    return type(value).__name__


def _check_inputs(pred, gold, timeout: float) -> None:
    if pred is not None and not isinstance(pred, str):
        raise TypeError(f"pred must be a str or None, got {_describe(pred)}")
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a str, got {_describe(gold)}")
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
    verdict = _fast_verdict(pred, gold)
    if verdict is not None:
        return verdict
    return _get_pool().grade([[Grader.MATHRL, pred, gold]], timeout, deadline)[0] == 1.0


def strings_equiv(a: str, b: str) -> bool:
    """Whether the answers ``a`` and ``b`` are equal at the string level: the same after normalisation
    (wrappers, spacing, units, ...), or the same plain number. No symbolic tier, so it is pure, quick and
    needs no worker; False where only the symbolic tier could tell (``\\sqrt{4}`` against ``2``)."""
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, str):
            raise TypeError(f"strings_equiv: {name} must be a str, got {_describe(value)}")
    return _fast_verdict(a, b) is True


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
        verdict = False if pred is None else _fast_verdict(pred, gold) if grader is Grader.MATHRL else None
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
    pool = _get_pool(preload=scorer_packages(scorer))
    pool.wait_started(WORKER_START_TIMEOUT)
    return pool.grade([[scorer, *request] for request in requests], timeout)


def warm_up(workers: int | None = None, timeout: float = WORKER_START_TIMEOUT, scorers: Sequence[str] = ()) -> None:
    """Start the worker pool now (``workers`` processes, default min(2, cpu_count); the packages of ``scorers``,
    keys of ``SCORERS``, imported ahead) and wait until all are ready, so that the first graded answers do not
    spend their timeout on start-up."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    pool = _get_pool(workers, frozenset().union(*map(scorer_packages, scorers)))
    deadline = time.monotonic() + timeout
    ready: list[_Worker] = []
    while len(ready) < pool.size and time.monotonic() < deadline:
        ready += pool.take(pool.size - len(ready), deadline)
    pool.give_back(ready)
    if len(ready) < pool.size:
        raise TimeoutError(f"only {len(ready)} of {pool.size} grading workers started within {timeout} s")
