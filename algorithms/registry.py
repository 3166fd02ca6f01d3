"""The algorithms the trainer knows, and the traits it must know of each before building one.

Torch-free on purpose: the command line checks flags against these traits (an episodic algorithm
compares samples within prompt groups; only algorithms with a critic take critic flags) before torch
is imported. Adding an algorithm is a module with a class following ``algorithms.base.Algorithm``
plus one entry in ``ALGORITHMS``.
"""

from __future__ import annotations

from dataclasses import dataclass

CRITICS = (None, "action", "token")


@dataclass(frozen=True)
class AlgorithmSpec:
    """``target``: "module:Class" (imported on first use).
    ``episodic``: collect exactly one episode per env per iteration (advantages compare whole episodes
    within a prompt group) instead of ``episode_length`` steps of episodes that span iterations.
    ``critic``: None, "action" (V(s) per step) or "token" (V per action token)."""

    target: str
    episodic: bool
    critic: str | None


ALGORITHMS = {
    "APPO": AlgorithmSpec("algorithms.appo:APPO", episodic=False, critic="action"),
    "GRPO": AlgorithmSpec("algorithms.grpo:GRPO", episodic=True, critic=None),
    "TPPO": AlgorithmSpec("algorithms.tppo:TPPO", episodic=False, critic="token"),
    "RLOO": AlgorithmSpec("algorithms.rloo:RLOO", episodic=True, critic=None),
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered traits of ``name`` (e.g. "GRPO")."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
