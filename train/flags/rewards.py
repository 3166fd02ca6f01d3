"""Flags of the rewards: the weighted --reward sources and the process reward model: ``RewardConfig``'s
options."""

from __future__ import annotations

from train.config import RewardConfig
from train.options import define_flags

define_flags(RewardConfig, __name__)
