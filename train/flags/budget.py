"""Flags of the run's budget: how many env steps, how often and how much to evaluate, the seed:
``BudgetConfig``'s options."""

from __future__ import annotations

from train.config import BudgetConfig
from train.options import define_flags

define_flags(BudgetConfig, __name__)
