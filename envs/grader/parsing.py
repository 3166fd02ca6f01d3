"""The symbolic tier's parser: a normalised answer in LaTeX or plain math -> a value built from sympy objects.

It reads numbers, + - * / ^, implicit products, \\frac, \\sqrt[n]{}, functions, tuples, intervals, sets, unions,
matrices, relations and \\pm by recursive descent, building sympy objects directly: model text never reaches
sympy's own parsers, which evaluate. It bounds depth, node count, literal sizes, exponents, factorials and
exact integer sizes (``limits``), so 9^{9^{9^9}} is rejected before sympy computes it. It runs in the grading
workers (``workers``), under their deadline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

import sympy

from .extraction import closing_brace
from .limits import (MAX_DECIMAL_EXPONENT, MAX_DEPTH, MAX_DIGITS, MAX_EXPONENT, MAX_FACTORIAL, MAX_INT_BITS,
                     MAX_ITEMS, MAX_NODES)
from .normalization import from_base


@dataclass(frozen=True)
class Tuple:
    """(a, b, ...) or an interval such as [0, 1); the brackets are part of the value."""
    items: tuple
    left: str
    right: str


@dataclass(frozen=True)
class Set:
    """\\{a, b\\}, {a, b}, a bare list a, b or the two values of a \\pm: order and repeats ignored."""
    items: tuple


@dataclass(frozen=True)
class Union:
    parts: tuple


@dataclass(frozen=True)
class Matrix:
    rows: tuple


@dataclass(frozen=True)
class Relation:
    """a < b <= c: ops[i] relates operands[i] and operands[i + 1]; ops from "< <= > >= = !="."""
    ops: tuple
    operands: tuple


PM = sympy.Symbol("\\pm")  # the sign of a \pm; no parsed name contains a backslash
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


def parse(text: str):
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
        return items[0] if len(items) == 1 else Set(tuple(items))

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
        return Relation(tuple(ops), tuple(operands)) if ops else operands[0]

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
        return Union(tuple(parts)) if len(parts) > 1 else parts[0]

    def _sum(self):
        value = self._term()
        while True:
            if self._accept("+"):
                value = self._add(value, self._term())
            elif self._accept("-"):
                value = self._add(value, self._mul(_MINUS_ONE, self._term()))
            elif self._accept("\\pm"):
                value = self._add(value, self._mul(PM, self._term()))
            elif self._accept("\\mp"):
                value = self._add(value, self._mul(-PM, self._term()))
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
                return self._mul(PM, self._unary())
            if self._accept("\\mp"):
                return self._mul(-PM, self._unary())
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
        value = from_base(digits, int(base)) if base.isdigit() and len(base) <= 2 else None
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
        return Tuple(tuple(items), opener, closer)

    def _group(self, closer: str, always_set: bool):
        if always_set and self._accept(closer):
            return Set(())
        items = self._items(closers=(closer,))
        self._expect(closer)
        return items[0] if len(items) == 1 and not always_set else Set(tuple(items))

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
            end = closing_brace(self.text, self.pos)
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
            return Set(())
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
        return Matrix(tuple(rows))
