"""Flags of the problems and the env: the dataset, the gymnasium id, what one action is, the prompt."""

from __future__ import annotations

from absl import flags

from train.config import ANSWER_INSTRUCTION, ActionLevel, EnvConfig
from train.options import define_flags

define_flags(EnvConfig, __name__)  # the options EnvConfig declares itself (the tool's)

flags.DEFINE_string("dataset_path", None, "Problems to train on: a JSONL/JSON file (MATH-500 or OpenR schema), a "
                    "directory holding {split}.jsonl, or hf://NAME[:split] (needs the datasets package). Given "
                    "alone, the env is MATH-v0.")
flags.DEFINE_string("dataset_name", None, "OpenR's subject filter for a MATH dataset (e.g. 'prealgebra'); "
                    "default: all subjects.")
flags.DEFINE_string("eval_dataset_path", None, "Held-out problems for evaluation: a path as --dataset_path takes, "
                    "logged under eval/; or comma-separated NAME=PATH sets, each evaluated and logged under "
                    "eval/NAME/ (an empty PATH: the default set), e.g. math500=envs/data/math500.jsonl,arith= ; "
                    "eval/accuracy and the best checkpoint then follow the first set. Default: the env's test split "
                    "(Arith-v0), or --dataset_path itself (e.g. MATH-500).")
flags.DEFINE_string("env_id", None, "A registered gymnasium id with a vector entry point (MathVectorEnv or "
                    "compatible), or 'module:EnvId' to import a registration module first (on PYTHONPATH). "
                    "Default: MATH-v0 with --dataset_path, else Arith-v0.")
flags.DEFINE_enum("action_level", ActionLevel.SOLUTION, [mode.value for mode in ActionLevel],
                  "What one env action is: a whole "
                  "solution (one generate call per episode), one reasoning step (generation stops at the step "
                  "delimiter) or one token (the env's token mode; --episode_length then counts tokens).")
flags.DEFINE_enum("prompt_template", "default", ("default", "qwen_math", "chat"), "How a problem becomes a prompt: "
                  "default ('Problem: ...\\nSolution:\\n'), qwen_math (Qwen2.5-Math's ChatML prompt), or chat (the "
                  "tokenizer's own chat template, generation prompt added; for instruct models).")
flags.DEFINE_string("env_kwargs", None, "JSON object of keywords for the env id (gymnasium.make's kwargs), e.g. "
                    "'{\"arith\": {\"digits\": 1, \"max_ops\": 2, \"num_train\": 3000}}' for Arith-v0's knobs or "
                    "'{\"levels\": [1, 2]}' for MATH-v0; a dict value updates the registered dict key by key. Applies "
                    "to the train and held-out envs.")
flags.DEFINE_string("answer_instruction", ANSWER_INSTRUCTION, "Sentence appended to the user turn of --prompt_template "
                    "chat, telling an instruct model where to put its answer (verl's math recipes append the same); "
                    "'' for none. Every role of a workflow reads it.")
flags.DEFINE_string("system_prompt", None, "System message of --prompt_template chat (and qwen_math). Default: "
                    "the template's own.")
flags.DEFINE_integer("episode_length", None, "Env steps per env per iteration (episodic algorithms: the longest "
                     "episode; longer ones are cut). Default: 1 with --action_level solution, else 8; in a multi-agent "
                     "env one step per turn, the workflow's most turns (or the env's max_steps).", lower_bound=1)
flags.DEFINE_integer("n_rollout_threads", 128, "Parallel envs (= samples per iteration); groups of --group_size "
                     "consecutive envs share a problem.", lower_bound=1)
flags.DEFINE_integer("group_size", None, "Samples per problem (consecutive envs sharing one). Default: 4 for "
                     "GRPO/RLOO (they compare samples within a group), 1 for APPO/TPPO.", lower_bound=1)
