"""Flags of Prefix-RL: the policy writes a prefix and a frozen target solver finishes it:
``PrefixRLConfig``'s options."""

from __future__ import annotations

from train.config import PrefixRLConfig
from train.options import define_flags

define_flags(PrefixRLConfig, __name__)
