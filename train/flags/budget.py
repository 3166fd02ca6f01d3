"""Flags of the run's budget: how many env steps, how often and how much to evaluate, the seed."""

from __future__ import annotations

from absl import flags

flags.DEFINE_integer("num_env_steps", 81_920, "Env steps to take in all, oversampled and background batches "
                     "included; iterations = ceil(num_env_steps / (episode_length * envs per iteration)), where "
                     "envs per iteration = n_rollout_threads (x oversample_factor for RLOO).", lower_bound=1)
flags.DEFINE_integer("eval_interval", 100, "Evaluate every this many iterations (and at the start and end); 0: "
                     "never.", lower_bound=0)
flags.DEFINE_integer("eval_limit", 1000, "Most held-out problems per evaluation.", lower_bound=1)
flags.DEFINE_integer("eval_batch_size", 500, "Solutions generated per evaluation batch (greedy ones, then "
                     "--eval_samples per problem).", lower_bound=1)
flags.DEFINE_integer("eval_samples", 0, "Sampled solutions per held-out problem at each evaluation, besides the "
                     "greedy one: logs pass@k (the unbiased estimator) as pass_at_k and maj@k (majority answer) as maj_at_k "
                     "for k = 1, 2, 4, ... and this number, and mean_at_<this number> (0: greedy only).", lower_bound=0)
flags.DEFINE_float("eval_temperature", 1.0, "Sampling temperature of --eval_samples (> 0).")
flags.DEFINE_float("eval_top_p", 1.0, "Nucleus sampling of --eval_samples (1: off).")
flags.DEFINE_integer("seed", 0, "Seed of torch, numpy, the problem sampler and generation.")
