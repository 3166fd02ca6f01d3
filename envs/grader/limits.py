"""The bounds on grading one answer: how much the parser may build from it and how close two numbers must be.

Model text is untrusted, so every tier is bounded; the limits stand in one place because the string tier
(``normalization``, ``comparison.fast_verdict``) and the symbolic tier (``parsing``, ``comparison``) must
agree on them, and a reader checking that no parse is unbounded finds them all here.
"""

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
