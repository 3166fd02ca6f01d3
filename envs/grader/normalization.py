"""An answer's canonical form at the string level: wrappers, spacing, sizing commands, units, thousands
separators and answer prefixes ("x =") dropped, aliases unified; and the exact value of a plain number
spelling (decimals, 3e5, fractions, mixed numbers, 204_5).

Linear-time regexes and exact fractions only, no sympy: the string tier runs in the caller's process on
untrusted text. The order of the steps matters (see ``normalize``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from .extraction import closing_brace
from .limits import MAX_DECIMAL_EXPONENT, MAX_DIGITS

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


def normalize(text: str) -> tuple[str, bool]:
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
            if not (text.startswith("\\boxed{") and closing_brace(text, len("\\boxed")) == len(text) - 1):
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


def drop_prefixes(a: str, b: str) -> tuple[str, str]:
    """Drop "x=" / "x\\in" answer prefixes: from both sides when they agree, from one side when the
    other has no relation at all; "\\in" always. "y=-x/2" vs "x+2y=0" stays a pair of equations."""
    prefix_a, rest_a = _split_prefix(a)
    prefix_b, rest_b = _split_prefix(b)
    if prefix_a and (prefix_a.endswith("\\in") or (prefix_a == prefix_b) or not _RELATION_MARK.search(b)):
        a = rest_a
    if prefix_b and (prefix_b.endswith("\\in") or (prefix_a == prefix_b) or not _RELATION_MARK.search(a)):
        b = rest_b
    return a, b


_DECIMAL = r"([0-9]+\.?[0-9]*|\.[0-9]+)"
_EXPONENT = r"([-+]?[0-9]{1,4})"
_DIGIT_ARG = r"(?:\{([0-9]+)\}|([0-9]))"
_PLAIN_DECIMAL = re.compile(rf"{_DECIMAL}(?:[eE]{_EXPONENT})?")
_PLAIN_SCIENTIFIC = re.compile(rf"{_DECIMAL}(?:\\times|\\cdot|\*)10\^(?:\{{{_EXPONENT}\}}|{_EXPONENT})")
_PLAIN_FRACTION = re.compile(rf"([0-9]*)\\frac{_DIGIT_ARG}{_DIGIT_ARG}")
_PLAIN_SLASH = re.compile(r"([0-9]+)/([0-9]+)")
_PLAIN_BASE = re.compile(r"([0-9]+)_(?:\{([0-9]+)\}|([0-9]+))")


def plain_number(text: str) -> Fraction | None:
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
        value = from_base(match.group(1), int(match.group(2) or match.group(3)))
    else:
        return None
    return None if value is None else sign * value


def _scaled(mantissa: str, exponent: str | None) -> Fraction | None:
    power = int(exponent or 0)
    return Fraction(mantissa) * Fraction(10) ** power if abs(power) <= MAX_DECIMAL_EXPONENT else None


def from_base(digits: str, base: int) -> int | None:
    """The value of the numeral ``digits`` in ``base``; None unless 2 <= base <= 36 and every digit is below it."""
    if not 2 <= base <= 36 or any(int(digit, 36) >= base for digit in digits):
        return None
    return int(digits, base)

