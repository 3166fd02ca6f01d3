"""Flags of data-parallel training under torchrun."""

from __future__ import annotations

from absl import flags

flags.DEFINE_float("dist_timeout", 600.0, "Under torchrun: seconds any collective (gradient all-reduce, statistics) "
                   "may wait for the other ranks before this rank fails with an error, so a rank that hangs or dies "
                   "ends the job instead of stalling it.", lower_bound=1.0)
flags.DEFINE_enum("data_parallel", "auto", ("auto", "ddp", "fsdp"), "Under torchrun: how the policy is split over "
                  "the ranks. ddp: every rank holds the whole model and optimizer state, gradients all-reduced; "
                  "fsdp: FSDP2 shards weights, gradients and optimizer state over the ranks (full fine-tuning only); "
                  "auto: fsdp for full fine-tuning, ddp for LoRA.")
