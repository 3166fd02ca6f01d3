"""Flags of remote services (the target, the PRM and the policy's generation behind servers, and how their
clients wait and retry): ``ServicesConfig``'s options."""

from __future__ import annotations

from train.config import ServicesConfig
from train.options import define_flags

define_flags(ServicesConfig, __name__)
