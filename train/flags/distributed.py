"""Flags of data-parallel training under torchrun: ``DistributedConfig``'s options."""

from __future__ import annotations

from train.config import DistributedConfig
from train.options import define_flags

define_flags(DistributedConfig, __name__)
