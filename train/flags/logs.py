"""Flags of logging and checkpoints (where a run writes, how often, resuming): ``LoggingConfig``'s options."""

from __future__ import annotations

from train.config import LoggingConfig
from train.options import define_flags

define_flags(LoggingConfig, __name__)
