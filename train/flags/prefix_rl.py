"""Flags of Prefix-RL: the policy writes a prefix and a frozen target solver finishes it."""

from __future__ import annotations

from absl import flags

flags.DEFINE_integer("handoff_steps", None, "Prefix-RL: an episode ends after this many policy actions and the "
                     "frozen target (--target_model_name_or_path, reward 'target') solves on from the prefix. "
                     "With --action_level solution and --max_new_tokens K the prefix is one action of at most K "
                     "tokens.", lower_bound=1)
flags.DEFINE_string("target_model_name_or_path", None, "Frozen target solver for the 'target' reward source "
                    "(Prefix-RL): a directory or a hub id (see --model_name_or_path).")
flags.DEFINE_integer("target_num_samples", 1, "Completions the target samples from each prefix; the 'target' "
                     "reward is the fraction that verify.", lower_bound=1)
flags.DEFINE_float("target_temperature", 0.0, "Sampling temperature of the target, and of a frozen --role_model role "
                   "(0: greedy; use > 0 with --target_num_samples > 1).", lower_bound=0.0)
flags.DEFINE_integer("target_max_new_tokens", 256, "Most tokens the target writes after the prefix, and a frozen "
                     "--role_model role's messages.", lower_bound=1)
