"""Flags of PRIME (RLOO with an implicit process reward model and accuracy-filtered prompt groups):
``PrimeConfig``'s options."""

from __future__ import annotations

from train.config import PrimeConfig
from train.options import define_flags

define_flags(PrimeConfig, __name__)
