"""The ``--reward`` flag's weights of reward sources, such as ``"outcome:1.0,prm:0.2"``.

The mixture they weigh is ``envs.rewards.RewardMixture``: every env combines its sources with it (the
multi-agent env beside its own outcome credit), so it lives in the env layer.
"""

from __future__ import annotations

import math
from typing import Sequence


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
