"""Flags of PRIME (RLOO with an implicit process reward model and accuracy-filtered prompt groups)."""

from __future__ import annotations

from absl import flags

flags.DEFINE_float("accuracy_lower_bound", 0.2, "PRIME: keep prompts whose group accuracy is >= this.")
flags.DEFINE_float("accuracy_upper_bound", 0.8, "PRIME: keep prompts whose group accuracy is <= this.")
flags.DEFINE_integer("oversample_factor", 4, "PRIME: sample this many times the prompts, keep "
                     "--n_rollout_threads / --group_size of those passing the accuracy filter.", lower_bound=1)
flags.DEFINE_float("implicit_prm_beta", 0.05, "PRIME: implicit PRM beta.")
flags.DEFINE_float("implicit_prm_lr", 1e-3, "PRIME: implicit PRM learning rate (PRIME's paper used 1e-6 on 7B "
                   "models).")
flags.DEFINE_float("process_coef", 0.2, "PRIME: weight of the implicit-PRM reward stream (0: RLOO on the outcome "
                   "stream alone, and no implicit PRM is built or trained).")
