"""Flags of rollout generation (the backend, sampling, asynchronous rollouts): ``GenerationConfig``'s options."""

from __future__ import annotations

from train.config import GenerationConfig
from train.options import define_flags

define_flags(GenerationConfig, __name__)
