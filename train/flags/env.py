"""Flags of the problems and the env: the dataset, the gymnasium id, what one action is, the prompt:
``EnvConfig``'s options."""

from __future__ import annotations

from train.config import EnvConfig
from train.options import define_flags

define_flags(EnvConfig, __name__)
