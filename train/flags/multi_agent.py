"""Flags of multi-agent workflows (Arith-Chain-v0, ...): roles' models, credit and group baselines:
``MultiAgentConfig``'s options."""

from __future__ import annotations

from train.config import MultiAgentConfig
from train.options import define_flags

define_flags(MultiAgentConfig, __name__)
