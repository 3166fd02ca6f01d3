"""Flags of the policy model: where its weights come from and how it runs."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("model_name_or_path", None, "Policy model: a Hugging Face model directory or a hub id (e.g. "
                    "Qwen/Qwen2.5-Math-1.5B, resolved through the Hugging Face cache; HF_HUB_OFFLINE=1 is honoured). "
                    "Default: the tiny Arith policy shipped in the package (models/tiny/shipped; on a "
                    "multi-agent env the tiny team model, which knows the workflows' roles).")
flags.DEFINE_string("revision", None, "Hub revision (branch, tag or commit) of every model flag given as a hub id. "
                    "Default: the hub's default branch.")
flags.DEFINE_string("device", "auto", "auto, cpu, cuda or cuda:N.")
flags.DEFINE_enum("dtype", "float32", ("float32", "bfloat16", "float16"),
                  "Compute dtype: matmuls run in it under autocast; trained weights stay fp32 (master weights) "
                  "and a LoRA's frozen base is stored in it.")
flags.DEFINE_integer("lora_rank", 0, "LoRA rank; 0 trains all weights.", lower_bound=0)
flags.DEFINE_boolean("gradient_checkpointing", False, "Recompute activations in the backward pass.")
flags.DEFINE_boolean("return_freed_memory", True, "On a CPU device, freed tensors of 1 MiB or more go back to the "
                     "OS at once, so the resident set follows the live tensors, for more system time per "
                     "allocation; --noreturn_freed_memory keeps glibc's default, which holds on to freed memory.")
flags.DEFINE_integer("torch_threads", 1, "torch intra-op CPU threads. 1 by default: on a machine whose cores other "
                     "processes share, more threads oversubscribe OpenMP.", lower_bound=1)
