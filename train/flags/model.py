"""Flags of the policy model: where its weights come from and how it runs: ``ModelConfig``'s options."""

from __future__ import annotations

from train.config import ModelConfig
from train.options import define_flags

define_flags(ModelConfig, __name__)
