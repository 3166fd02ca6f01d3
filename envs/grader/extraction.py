"""The final answer of a model's text: the content of its last ``\\boxed{}``/``\\fbox{}``, else of its last
``<answer>...</answer>``, else what follows its last "answer is".

Linear-time scanning only (model text is untrusted); the caller grades what this returns. ``closing_brace``
is also how normalisation and the parser find a LaTeX group's end, and ``describe`` how every entry point of
the grader names a caller's bad value.
"""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_ANSWER_IS = re.compile(r"answer\s++is\s*+:?", re.IGNORECASE)
ANSWER_TAGS = ("<answer>", "</answer>")  # DeepSeek-R1-Zero's and reasoning-gym's answer format


def extract_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``/``\\fbox{...}`` (also ``\\boxed 5``); else of the last
    ``<answer>...</answer>``; else what follows the last "answer is" on its line; else None. None too when the
    last box is unclosed. Linear in ``len(text)``."""
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a str, got {describe(text)}")
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
    end = closing_brace(text, start)
    if end is None:
        return None
    return text[start + 1:end].strip() or None


def closing_brace(text: str, start: int) -> int | None:
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


def describe(value) -> str:
    """Type and value for error messages; repr only of plain scalars (any other repr may be code)."""
    if isinstance(value, (bytes, int, float, complex)):
        return f"{type(value).__name__} {value!r:.80}"
    return type(value).__name__

