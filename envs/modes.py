"""The env's modes, one string enum each: what one action is, the tool an action may call, how a
multi-agent env credits its roles. The trainer's options take these same enums (``train.config``).

A member equals its string (``ActionLevel.STEP == "step"``), so a user's env keywords may be either;
each env turns them into members once, in its constructor (``member_of``), and compares members after.
Stdlib only; importing it runs the package's ``__init__`` (gymnasium, numpy, sympy), never torch: the
trainer's flags are built from these and a bad flag fails before a model library loads.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class ActionLevel(enum.StrEnum):
    """What one env action is."""

    SOLUTION = "solution"  # a whole solution: one generate call per episode (the env's step mode, max_steps=1)
    STEP = "step"  # one reasoning step: generation stops at the step delimiter
    TOKEN = "token"  # one token (the env's token mode)


class Tool(enum.StrEnum):
    """A tool the policy may call between reasoning steps, or none."""

    PYTHON = "python"  # a step ending in a fenced python block runs in a sandbox
    NONE = "none"  # no tool, even where the env id has one


class RewardAssignment(enum.StrEnum):
    """How a multi-agent env credits each role."""

    TEAM = "team"  # the verified final answer, to every role that acted
    INDIVIDUAL = "individual"  # each role's own verifiable output
    COUNTERFACTUAL = "counterfactual"  # the team outcome minus the outcome without the role's messages


class Grader(enum.StrEnum):
    """What decides whether a final answer equals the reference (``envs.grader.GRADERS``)."""

    MATHRL = "mathrl"  # this project's grader (envs.grader): string, number and bounded symbolic tiers
    MATH_VERIFY = "math_verify"  # Hugging Face's math-verify, as TRL's accuracy_reward and verl grade (extra)


Mode = TypeVar("Mode", bound=enum.StrEnum)


def member_of(allowed: tuple[Mode, ...], value: object, name: str, hint: str = "") -> Mode:
    """``value`` (a member of ``allowed`` or its string) as that member; else a ValueError naming the
    keyword ``name``, the allowed strings and ``hint`` (what to do instead)."""
    for member in allowed:
        if value == member:
            return member
    choices = ", ".join(repr(member.value) for member in allowed)
    shown = value.value if isinstance(value, enum.Enum) else value
    raise ValueError(f"{name}={shown!r} must be one of {choices}{hint}")
