"""A weighted mixture of reward models, parsed from a flag such as ``--reward "outcome:1.0,prm:0.2"``.

Each source scores the batch once; the per-step reward is the weighted sum; every source's own
reward stays visible in ``components`` (for logging, and so that RLOO can keep PRIME's outcome and
process streams apart).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from envs.rewards import RewardModel, RewardOutput, StepContext


def parse_reward_spec(spec: str, known: Sequence[str]) -> dict[str, float]:
    """``"outcome:1.0,prm:0.2"`` -> {"outcome": 1.0, "prm": 0.2}; a bare name weighs 1.0.

    Fails on unknown names, repeated names, weights that are not finite numbers, and an empty spec.
    """
    weights: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, weight_text = part.partition(":")
        name = name.strip()
        if name not in known:
            raise ValueError(f"--reward names unknown source {name!r} in {spec!r}; known sources: {', '.join(known)}")
        if name in weights:
            raise ValueError(f"--reward names {name!r} twice in {spec!r}")
        try:
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            raise ValueError(f"--reward weight {weight_text!r} of {name!r} is not a number (in {spec!r})") from None
        if not math.isfinite(weight):
            raise ValueError(f"--reward weight of {name!r} must be finite, got {weight_text!r}")
        weights[name] = weight
    if not weights:
        raise ValueError(f"--reward {spec!r} names no source; e.g. 'outcome:1.0,prm:0.2'")
    return weights


class RewardMixture:
    """sum_k weight_k * reward_k over the given models (keyed by source name)."""

    name = "mixture"

    def __init__(self, models: Mapping[str, RewardModel], weights: Mapping[str, float]):
        missing = set(weights) - set(models)
        if missing:
            raise ValueError(f"reward weights name {sorted(missing)} but no model was built for them")
        self.models = {name: models[name] for name in weights}
        self.weights = dict(weights)

    def score(self, contexts: Sequence[StepContext]) -> RewardOutput:
        """Weighted sum [B] of every source's reward, each scoring the batch once; ``correct`` comes from
        the last source that gives it."""
        rewards = np.zeros(len(contexts), dtype=np.float64)
        components: dict[str, np.ndarray] = {}
        correct = None
        for name, model in self.models.items():
            output = model.score(contexts)
            rewards += self.weights[name] * np.asarray(output.rewards, dtype=np.float64)
            components.update({key: np.asarray(value) for key, value in output.components.items()})
            components.setdefault(name, np.asarray(output.rewards, dtype=np.float64))
            correct = output.correct if output.correct is not None else correct
        return RewardOutput(rewards=rewards, components=components, correct=correct)
