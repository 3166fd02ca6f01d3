"""Flags of the learning algorithm: which one, the optimiser, and the losses' coefficients:
``LearningConfig``'s options."""

from __future__ import annotations

from train.config import LearningConfig
from train.options import define_flags

define_flags(LearningConfig, __name__)
