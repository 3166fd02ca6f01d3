"""Flags of rollout generation: the backend, sampling, and asynchronous rollouts."""

from __future__ import annotations

from absl import flags

flags.DEFINE_enum("generation_backend", "hf", ("hf", "vllm", "vllm_server"), "Generation backend: HF "
                  "transformers in this process, a vLLM engine in this process, or vLLM servers at --vllm_url.")
flags.DEFINE_integer("max_new_tokens", 64, "Most tokens per action (per step, or per solution).", lower_bound=1)
flags.DEFINE_float("temperature", 0.5, "Sampling temperature for rollouts (> 0; evaluation is greedy). Large models "
                   "are commonly sampled at 1.0.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling for rollouts (1: off).")
flags.DEFINE_boolean("async_rollouts", None, "Generate the next batch with a copy of the policy in a second "
                     "thread while the current one trains (on a CPU: a second core), at most --max_policy_lag "
                     "updates behind; ratios are taken against the behaviour log-probs recorded at generation. "
                     "Default: on with --generation_backend=hf for APPO, and for every algorithm on a CPU.")
flags.DEFINE_integer("max_policy_lag", 1, "With --async_rollouts: most policy updates a batch may lag.",
                     lower_bound=1)
