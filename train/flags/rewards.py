"""Flags of the rewards: the weighted --reward sources and the process reward model."""

from __future__ import annotations

from absl import flags

from train.config import DEFAULT_PRM_REWARD, PRM_TYPES, REWARD_SOURCES

flags.DEFINE_string("reward", None, "Weighted reward sources, e.g. 'outcome:1.0,prm:0.2' (sources: "
                    f"{', '.join(REWARD_SOURCES)}). Default: {DEFAULT_PRM_REWARD!r} with a PRM, else the env id's "
                    "declared default (Arith-v0: 'outcome:1.0,steps:1.0'; MATH and the workflows: 'outcome'). On a "
                    "multi-agent env 'outcome' is the --reward_assignment credit and the other sources score each "
                    "answering role's message as one solution, paid to that role.")
flags.DEFINE_string("prm_model_name_or_path", None, "Process reward model: a directory or a hub id (see "
                    "--model_name_or_path); enables the 'prm' reward source (default --reward becomes "
                    f"{DEFAULT_PRM_REWARD!r}).")
flags.DEFINE_string("prm_checkpoint_path", None, "Optional LoRA adapter directory applied on top of the PRM.")
flags.DEFINE_enum("prm_type", "shepherd", sorted(PRM_TYPES), "PRM kind: shepherd (Math-Shepherd step tags; "
                  "OpenR's 'MS') or classifier (Qwen2.5-Math-PRM style; OpenR's 'Qwen').", case_sensitive=False)
flags.DEFINE_string("prm_step_tag", None, "The PRM's step marker: for shepherd PRMs the tag after each step "
                    "whose '+' probability is the score (default 'ки', Math-Shepherd's); for classifier PRMs the "
                    "separator after each step (default '<extra_0>', Qwen2.5-Math-PRM's). It must be one token "
                    "of the PRM's tokenizer.")
flags.DEFINE_float("prm_kv_cache_mb", None, "MiB of PRM key/values kept between env steps, so each step runs only "
                   "the new step's tokens (same scores); size it for every env's trajectory or it thrashes. 0 "
                   "recomputes every text in full. Default: 1024 for shepherd PRMs; classifier PRMs always "
                   "recompute (only 0 is allowed).", lower_bound=0)
