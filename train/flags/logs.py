"""Flags of logging and checkpoints: where a run writes, how often, and resuming."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("logdir", "runs", "TensorBoard and checkpoint root: <logdir>/<experiment>/<run>.")
flags.DEFINE_string("experiment_name", None, "Name of the run's directory under --logdir. Default: "
                    "<algorithm>_<env>.")
flags.DEFINE_integer("log_interval", 1, "Write training scalars every this many iterations.", lower_bound=1)
flags.DEFINE_integer("save_interval", 100, "Save a checkpoint every this many iterations (and at the end); 0: only "
                     "at the end.", lower_bound=0)
flags.DEFINE_string("resume", None, "Continue a run from a checkpoint: 'auto' = the newest complete checkpoint "
                    "under <logdir>/<experiment> (a fresh start if there is none), or a checkpoint directory "
                    "<run>/checkpoints/iter_N. Restores weights, optimizer, scheduler, RNGs, the env's problem "
                    "order and the counters; TensorBoard continues in the same run directory.")
flags.DEFINE_integer("keep_checkpoints", 2, "Keep only the newest this many checkpoints (older complete ones are "
                     "deleted after each save; <run>/best is kept apart); 0: keep all. Hugging Face's "
                     "save_total_limit, verl's max_actor_ckpt_to_keep.", lower_bound=0)
flags.DEFINE_enum("save_dtype", "auto", ("auto", "float32", "bfloat16", "float16"), "Dtype of the weights of "
                  "exported policies (<run>/best): auto = the training dtype (--dtype). Checkpoints keep the "
                  "weights as the optimizer steps them, so that a resume continues exactly.")
flags.DEFINE_boolean("save_best", True, "After an evaluation whose held-out accuracy beats every earlier one, "
                     "write the policy to <run>/best (Hugging Face format; loadable by from_pretrained and "
                     "--model_name_or_path).")
