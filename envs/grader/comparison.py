"""Whether two answers are equal, in two tiers: the string tier (``fast_verdict``: normalised strings, plain
numbers as exact fractions, words; pure and quick, no sympy) and the symbolic tier (``symbolic_verdict``: both
sides parsed, then compared).

Parsed values compare structurally, then by evaluating both sides at three fixed pseudo-random points in
complex floating point (sympy's big floats where that overflows); never with simplify, whose running time
has no useful bound. Relations compare as proportional lhs - rhs; one-variable inequalities also as
intervals. Integers compare exactly, anything else within ``REL_TOL``. The symbolic tier may be slow, so
it runs only in the grading workers (``workers``), under their deadline.
"""

from __future__ import annotations

import cmath
import hashlib
import math
import re
from fractions import Fraction

import sympy

from .limits import ABS_TOL, MAX_ANSWER_CHARS, REL_TOL
from .normalization import drop_prefixes, normalize, plain_number
from .parsing import PM, Matrix, Relation, Set, Tuple, Union, parse

_WORD = re.compile(r"[A-Za-z]{3,}")


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


def fast_verdict(pred: str, gold: str) -> bool | None:
    """The verdict when string-level work decides it, else None (needs the symbolic tier)."""
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return pred.strip() == gold.strip()
    (a, a_percent), (b, b_percent) = normalize(pred), normalize(gold)
    a, b = drop_prefixes(a, b)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = plain_number(a), plain_number(b)
    if x is not None and y is not None:
        return _numbers_match(x, y, a_percent, b_percent)
    if _WORD.fullmatch(a) or _WORD.fullmatch(b):
        return a.lower() == b.lower()
    return None


def symbolic_verdict(pred: str, gold: str) -> bool:
    """The full verdict, sympy included; may be slow, so it runs in a worker process."""
    fast = fast_verdict(pred, gold)
    if fast is not None:
        return fast
    (a, a_percent), (b, b_percent) = normalize(pred), normalize(gold)
    a, b = drop_prefixes(a, b)
    x, y = parse(a), parse(b)
    if _same(x, y):
        return True
    if a_percent != b_percent and isinstance(x, sympy.Expr) and isinstance(y, sympy.Expr):
        return _same(x / 100, y) if a_percent else _same(x, y / 100)
    return False


def _same(a, b) -> bool:
    a, b = _expand_pm(a), _expand_pm(b)
    if isinstance(a, Relation) or isinstance(b, Relation):
        return _same_with_relation(a, b)
    if isinstance(a, Set) or isinstance(b, Set):
        return _same_items(_items_of(a), _items_of(b))
    if isinstance(a, Union) or isinstance(b, Union):
        return _same_items(_parts_of(a), _parts_of(b))
    if isinstance(a, Matrix) or isinstance(b, Matrix):
        return _same_matrix(a, b)
    if isinstance(a, Tuple) and isinstance(b, Tuple):
        return ((a.left, a.right) == (b.left, b.right) and len(a.items) == len(b.items)
                and all(_same(x, y) for x, y in zip(a.items, b.items)))
    if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr):
        return _exprs_equal(a, b)
    return False


def _expand_pm(value):
    """a \\pm b -> the set {a + b, a - b}; sets absorb the expansions of their items."""
    if isinstance(value, sympy.Expr) and value.has(PM):
        return Set((value.xreplace({PM: 1}), value.xreplace({PM: -1})))
    if isinstance(value, Set):
        items = []
        for item in value.items:
            item = _expand_pm(item)
            items.extend(item.items if isinstance(item, Set) else [item])
        return Set(tuple(items))
    return value


def _items_of(value) -> tuple:
    return value.items if isinstance(value, Set) else (value,)


def _parts_of(value) -> tuple:
    return value.parts if isinstance(value, Union) else (value,)


def _same_items(xs: tuple, ys: tuple) -> bool:
    """Equal as sets: every item has an equal partner on the other side (identical ones first)."""
    return (all(x in ys or any(_same(x, y) for y in ys) for x in xs)
            and all(y in xs or any(_same(x, y) for x in xs) for y in ys))


def _same_matrix(a, b) -> bool:
    """Matrices cell by cell; a row or column vector also equals a tuple (a, b, c)."""
    if isinstance(a, Tuple):
        a, b = b, a
    if isinstance(b, Tuple):
        cells = [cell for row in a.rows for cell in row]
        vector = len(a.rows) == 1 or all(len(row) == 1 for row in a.rows)
        return vector and b.left == "(" and len(cells) == len(b.items) and all(map(_same, cells, b.items))
    if not isinstance(a, Matrix) or not isinstance(b, Matrix):
        return False
    shape = [len(row) for row in a.rows] == [len(row) for row in b.rows]
    return shape and all(_same(x, y) for row_a, row_b in zip(a.rows, b.rows) for x, y in zip(row_a, row_b))


_FLIPPED = {">": "<", ">=": "<="}


def _ascending(relation: Relation) -> Relation:
    """b > a -> a < b, so that equal relations line up operand by operand."""
    if all(op in _FLIPPED for op in relation.ops):
        return Relation(tuple(_FLIPPED[op] for op in reversed(relation.ops)), tuple(reversed(relation.operands)))
    return relation


def _same_with_relation(a, b) -> bool:
    if isinstance(a, Relation) and isinstance(b, Relation):
        return _relations_equal(_ascending(a), _ascending(b))
    relation, other = (a, b) if isinstance(a, Relation) else (b, a)
    relation = _ascending(relation)
    if relation.ops == ("=",) and isinstance(relation.operands[0], sympy.Symbol):
        return _same(relation.operands[1], other)  # x = 5 vs 5
    interval = _as_interval(relation)
    return interval is not None and _same(interval, other)


def _relations_equal(a: Relation, b: Relation) -> bool:
    if a.ops != b.ops or len(a.operands) != len(b.operands):
        return False
    if all(_same(x, y) for x, y in zip(a.operands, b.operands)):
        return True
    if len(a.ops) == 1 and all(isinstance(x, sympy.Expr) for x in a.operands + b.operands):
        difference_a, difference_b = a.operands[0] - a.operands[1], b.operands[0] - b.operands[1]
        return _proportional(difference_a, difference_b, positive=a.ops[0] in ("<", "<="))
    return False


def _as_interval(relation: Relation):
    """x < 3 -> (-oo, 3); 1 <= x < 2 -> [1, 2); x != 0 -> (-oo, 0) U (0, oo); else None."""
    ops, operands = relation.ops, relation.operands
    if not all(isinstance(x, sympy.Expr) for x in operands):
        return None
    lone = [isinstance(x, sympy.Symbol) for x in operands]
    constant = [not x.free_symbols for x in operands]
    left = {"<": "(", "<=": "["}
    right = {"<": ")", "<=": "]"}
    if len(ops) == 1 and ops[0] in left and lone[0] and constant[1]:
        return Tuple((-sympy.oo, operands[1]), "(", right[ops[0]])
    if len(ops) == 1 and ops[0] in left and lone[1] and constant[0]:
        return Tuple((operands[0], sympy.oo), left[ops[0]], ")")
    if len(ops) == 2 and all(op in left for op in ops) and lone[1] and constant[0] and constant[2]:
        return Tuple((operands[0], operands[2]), left[ops[0]], right[ops[1]])
    if ops == ("!=",) and lone[0] and constant[1]:
        return Union((Tuple((-sympy.oo, operands[1]), "(", ")"), Tuple((operands[1], sympy.oo), "(", ")")))
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

