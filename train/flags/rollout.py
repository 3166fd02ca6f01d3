"""Flags of what happens to rollouts before the loss (dynamic sampling, cut-off answers, rollout correction):
``RolloutConfig``'s options."""

from __future__ import annotations

from train.config import RolloutConfig
from train.options import define_flags

define_flags(RolloutConfig, __name__)
