"""Every command-line flag of train_math.py, defined once, with validators that run at parse time.

Parsing (absl) rejects unknown flags, reads ``--flagfile``, and runs the validators below before
any model is loaded or heavy module imported: a wrong path, a bad value or a contradictory
combination fails at once with a message that names the flag and the fix. No flag is ever
changed after parsing; flags whose default depends on others (``--env_id``, ``--reward``,
``--episode_length``, ``--group_size``, ``--async_rollouts``, ``--experiment_name``) are resolved
by the ``resolved_*`` functions, which only fill in values the user did not give. Flags that only
another algorithm reads are refused (``check_algorithm_specific``) instead of silently ignored.

OpenR's flags keep their names and meanings (``--dataset_path``, ``--model_name_or_path``,
``--prm_model_name_or_path``, ``--algorithm_name``, ``--num_mini_batch``, ``--ppo_epoch``, ...), so
OpenR's ``train_math.py`` command runs unchanged.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from absl import flags

from algorithms.registry import ALGORITHMS

FLAGS = flags.FLAGS

ALGORITHM_NAMES = tuple(ALGORITHMS)
PRM_TYPES = {"shepherd": "shepherd", "classifier": "classifier", "ms": "shepherd", "qwen": "classifier"}
REWARD_SOURCES = ("outcome", "prm", "target", "steps")
DEFAULT_PRM_REWARD = "outcome:1.0,prm:0.2"

# --- OpenR's flags ---------------------------------------------------------------------------
flags.DEFINE_string("dataset_path", None, "Problems to train on: a JSONL/JSON file (MATH-500 or OpenR schema), a "
                    "directory holding {split}.jsonl, or hf://NAME[:split]. Given alone, the env is MATH-v0.")
flags.DEFINE_string("dataset_name", None, "OpenR's subject filter for a MATH dataset (e.g. 'prealgebra'); "
                    "default: all subjects.")
flags.DEFINE_string("model_name_or_path", None, "Policy model directory (Hugging Face format). Default: the "
                    "built-in tiny Arith policy (models.tiny, built and cached on first use; on a multi-agent env the tiny team "
                    "model, which knows the workflows' roles).")
flags.DEFINE_string("prm_model_name_or_path", None, "Process reward model directory; enables the 'prm' reward "
                    f"source (default --reward becomes {DEFAULT_PRM_REWARD!r}).")
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
flags.DEFINE_enum("algorithm_name", "GRPO", ALGORITHM_NAMES, "RL algorithm.")
flags.DEFINE_integer("num_mini_batch", 1, "Minibatches (optimizer steps) per epoch over each rollout.", lower_bound=1)
flags.DEFINE_integer("ppo_epoch", 1, "Epochs over each rollout.", lower_bound=1)
flags.DEFINE_integer("num_env_steps", 81_920, "Env steps to take in all, oversampled and background batches "
                     "included; iterations = ceil(num_env_steps / (episode_length * envs per iteration)), where "
                     "envs per iteration = n_rollout_threads (x oversample_factor for RLOO). The default: 640 "
                     "iterations of 128 envs, about 10 minutes of the tiny Arith policy on a 2-core CPU.",
                     lower_bound=1)
flags.DEFINE_integer("episode_length", None, "Env steps per env per iteration (episodic algorithms: the longest "
                     "episode; longer ones are cut). Default: 1 with --action_level solution, else 8; in a multi-agent "
                     "env one step per turn, the workflow's most turns (or the env's max_steps).", lower_bound=1)
flags.DEFINE_multi_string("role_model", [], "ROLE=DIR (repeatable): a frozen role of a multi-agent workflow (one "
                          "its Workflow marks trainable=False, e.g. Arith-Prefix-v0's solver: Prefix-RL's frozen "
                          "target) speaks with the model in DIR instead of the policy. Frozen roles are never trained "
                          "on; without a model of their own they speak with the policy.")
flags.DEFINE_enum("agent_groups", "role", ("role", "joint"), "Multi-agent envs, GRPO/RLOO: the group baseline "
                  "compares one role's samples of one problem (role, normalised per role), or every role's samples "
                  "of the problem together (joint, MAGRPO's team baseline).")
flags.DEFINE_enum("reward_assignment", "team", ("team", "individual", "counterfactual"), "Multi-agent envs "
                  "(Arith-Chain-v0, ...): how each role is credited. team: the verified final answer, to every role "
                  "that acted; individual: each role's own verifiable output (its answer; a verifier's verdict "
                  "against the truth); counterfactual: the team outcome minus the outcome with the role's messages "
                  "replaced by its default (e.g. the verifier always accepting).")
flags.DEFINE_integer("n_rollout_threads", 128, "Parallel envs (= samples per iteration); groups of --group_size "
                     "consecutive envs share a problem.", lower_bound=1)
flags.DEFINE_integer("eval_interval", 100, "Evaluate every this many iterations (and at the start and end); 0: "
                     "never.", lower_bound=0)
flags.DEFINE_integer("log_interval", 1, "Write training scalars every this many iterations.", lower_bound=1)
flags.DEFINE_integer("save_interval", 100, "Save a checkpoint every this many iterations (and at the end); 0: only "
                     "at the end.", lower_bound=0)
flags.DEFINE_integer("max_new_tokens", 64, "Most tokens per action (per step, or per solution).", lower_bound=1)
flags.DEFINE_integer("gradient_cp_steps", 1, "Gradient accumulation: micro-batches per minibatch.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of torch, numpy, the problem sampler and generation.")
flags.DEFINE_string("experiment_name", None, "Name of the run's directory under --logdir. Default: "
                    "<algorithm>_<env>.")

# --- Environment and rewards ------------------------------------------------------------------
flags.DEFINE_string("env_id", None, "A registered gymnasium id with a vector entry point (MathVectorEnv or "
                    "compatible), or 'module:EnvId' to import a registration module first. Default: MATH-v0 with "
                    "--dataset_path, else Arith-v0.")
flags.DEFINE_enum("action_level", "solution", ("solution", "step", "token"), "What one env action is: a whole "
                  "solution (one generate call per episode), one reasoning step (generation stops at the step "
                  "delimiter) or one token (the env's token mode; --episode_length then counts tokens).")
flags.DEFINE_integer("handoff_steps", None, "Prefix-RL: an episode ends after this many policy actions and the "
                     "frozen target (--target_model_name_or_path, reward 'target') solves on from the prefix. "
                     "With --action_level solution and --max_new_tokens K the prefix is one action of at most K "
                     "tokens.", lower_bound=1)
flags.DEFINE_string("reward", None, "Weighted reward sources, e.g. 'outcome:1.0,prm:0.2' (sources: "
                    f"{', '.join(REWARD_SOURCES)}). Default: 'outcome', or {DEFAULT_PRM_REWARD!r} with a PRM. On a "
                    "multi-agent env 'outcome' is the --reward_assignment credit and the other sources score each "
                    "answering role's message as one solution, paid to that role.")
flags.DEFINE_string("target_model_name_or_path", None, "Frozen target solver for the 'target' reward source "
                    "(Prefix-RL).")
flags.DEFINE_integer("target_num_samples", 1, "Completions the target samples from each prefix; the 'target' "
                     "reward is the fraction that verify.", lower_bound=1)
flags.DEFINE_float("target_temperature", 0.0, "Sampling temperature of the target, and of a frozen --role_model role "
                   "(0: greedy; use > 0 with --target_num_samples > 1).", lower_bound=0.0)
flags.DEFINE_integer("target_max_new_tokens", 256, "Most tokens the target writes after the prefix, and a frozen "
                     "--role_model role's messages.", lower_bound=1)
# --- Remote services (big models behind servers) ---------------------------------------------
flags.DEFINE_string("target_url", None, "The 'target' reward's frozen solver behind OpenAI-compatible completions "
                    "servers (`vllm serve`), instead of --target_model_name_or_path: URL[,URL...]; each request "
                    "goes to the URL with the fewest in flight.")
flags.DEFINE_string("target_model_name", None, "The target's served model name (default: the one model the "
                    "--target_url servers serve).")
flags.DEFINE_string("prm_url", None, "PRM server(s) started with `python -m reward_models.serve`, instead of "
                    "--prm_model_name_or_path: URL[,URL...]. Enables the 'prm' reward source.")
flags.DEFINE_string("prm_model_name", None, "The PRM's served model name (default: the one the server serves).")
flags.DEFINE_string("vllm_url", None, "--generation_backend=vllm_server: the vLLM server(s) serving "
                    "--model_name_or_path, URL[,URL...] (see the README: LoRA policies need --enable-lora, full "
                    "fine-tuning VLLM_SERVER_DEV_MODE=1).")
flags.DEFINE_string("vllm_model_name", None, "The policy's served model name on --vllm_url (default: the one "
                    "model the servers serve).")
flags.DEFINE_string("vllm_sync_dir", None, "Where new policy weights are written for the --vllm_url servers to "
                    "load (a path they can read). Default: <run dir>/sync.")
flags.DEFINE_float("service_connect_timeout", 5.0, "Seconds to connect to a --*_url server before the attempt "
                   "counts as failed.")
flags.DEFINE_float("service_read_timeout", 300.0, "Seconds a --*_url server may stay silent on a request (a "
                   "batch of long completions takes a while) before the attempt counts as failed.")
flags.DEFINE_integer("service_retries", 4, "Retries of a request after connection errors, timeouts and HTTP "
                     "502/503/504 (never after 4xx), with exponential backoff and jitter; then the iteration fails, "
                     "its start saved.", lower_bound=0)
flags.DEFINE_float("service_backoff", 1.0, "Seconds before the first retry (doubling each time, at most 30).")
flags.DEFINE_integer("service_max_in_flight", 8, "Most requests in flight per --*_url server.", lower_bound=1)
flags.DEFINE_string("eval_dataset_path", None, "Held-out problems for evaluation. Default: the env's test split "
                    "(Arith-v0), or --dataset_path itself (e.g. MATH-500).")
flags.DEFINE_integer("eval_limit", 1000, "Most held-out problems per evaluation.", lower_bound=1)
flags.DEFINE_integer("eval_batch_size", 500, "Problems evaluated per batch (greedy decoding).", lower_bound=1)
flags.DEFINE_integer("group_size", None, "Samples per problem (consecutive envs sharing one). Default: 4 for "
                     "GRPO/RLOO (they compare samples within a group; on the tiny Arith policy 32 problems x 4 "
                     "learned faster than 16 x 8 at 128 envs), 1 for APPO/TPPO.", lower_bound=1)

# --- Model, generation, devices --------------------------------------------------------------
flags.DEFINE_enum("generation_backend", "hf", ("hf", "vllm", "vllm_server"), "Generation backend: HF "
                  "transformers in this process, a vLLM engine in this process, or vLLM servers at --vllm_url.")
flags.DEFINE_string("device", "auto", "auto, cpu, cuda or cuda:N.")
flags.DEFINE_enum("dtype", "float32", ("float32", "bfloat16", "float16"), "Compute dtype (fp32 master weights).")
flags.DEFINE_integer("lora_rank", 0, "LoRA rank; 0 trains all weights.", lower_bound=0)
flags.DEFINE_boolean("gradient_checkpointing", False, "Recompute activations in the backward pass.")
flags.DEFINE_boolean("share_policy", True, "Multi-agent envs: every role acts with the one policy, told apart by its "
                     "prompt; --noshare_policy gives each trained role a LoRA adapter of its own on the shared base "
                     "(needs --lora_rank > 0; generated by --generation_backend hf or vllm, every role in one "
                     "call), all trained in the same optimizer step.")
flags.DEFINE_float("dist_timeout", 600.0, "Under torchrun: seconds any collective (gradient all-reduce, statistics) "
                   "may wait for the other ranks before this rank fails with an error, so a rank that hangs or dies "
                   "ends the job instead of stalling it.", lower_bound=1.0)
flags.DEFINE_enum("data_parallel", "auto", ("auto", "ddp", "fsdp"), "Under torchrun: how the policy is split over "
                  "the ranks. ddp: every rank holds the whole model and optimizer state, gradients all-reduced; "
                  "fsdp: FSDP2 shards weights, gradients and optimizer state over the ranks (full fine-tuning only); "
                  "auto: fsdp for full fine-tuning, ddp for LoRA.")
flags.DEFINE_integer("torch_threads", 1, "torch intra-op CPU threads. 1 by default: on a shared 2-core machine "
                     "two threads ran the tiny model 10-18x slower than one (OpenMP oversubscription).", lower_bound=1)
flags.DEFINE_float("temperature", 0.5, "Sampling temperature for rollouts (> 0; evaluation is greedy). 0.5 on the "
                   "tiny Arith policy: its samples at 1.0 are right half as often as its greedy solutions (0.17 "
                   "against 0.28), and 0.5 raised held-out greedy accuracy faster; large models are commonly "
                   "sampled at 1.0.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling for rollouts (1: off).")
flags.DEFINE_boolean("async_rollouts", None, "Generate the next batch with a copy of the policy in a second "
                     "thread while the current one trains (on a CPU: a second core), at most --max_policy_lag "
                     "updates behind; ratios are taken against the behaviour log-probs recorded at generation. "
                     "Default: on with --generation_backend=hf for APPO, and for every algorithm on a CPU (the tiny "
                     "default run: 2.35 instead of 1.47 iterations/s at 128 envs on 2 cores).")
flags.DEFINE_integer("max_policy_lag", 1, "With --async_rollouts: most policy updates a batch may lag.",
                     lower_bound=1)
flags.DEFINE_string("logdir", "runs", "TensorBoard and checkpoint root: <logdir>/<experiment>/<run>.")
flags.DEFINE_string("resume", None, "Continue a run from a checkpoint: 'auto' = the newest complete checkpoint "
                    "under <logdir>/<experiment> (a fresh start if there is none), or a checkpoint directory "
                    "<run>/checkpoints/iter_N. Restores weights, optimizer, scheduler, RNGs, the env's problem "
                    "order and the counters; TensorBoard continues in the same run directory.")
flags.DEFINE_integer("keep_checkpoints", 0, "Keep only the newest this many checkpoints (older complete ones are "
                     "deleted after each save); 0: keep all.", lower_bound=0)
flags.DEFINE_boolean("save_best", True, "After an evaluation whose held-out accuracy beats every earlier one, "
                     "write the policy to <run>/best (Hugging Face format; loadable by from_pretrained and "
                     "--model_name_or_path).")
flags.DEFINE_integer("max_nonfinite_steps", 3, "A non-finite loss or gradient skips that optimizer step; this many "
                     "in a row stop the run with an error (the last checkpoint is kept as the last good one).",
                     lower_bound=1)

# --- Optimisation -----------------------------------------------------------------------------
flags.DEFINE_float("lr", 1e-4, "Policy learning rate (AdamW). On the 1.1M tiny Arith policy (GRPO, 32 problems x "
                   "4 samples at temperature 0.5) 1e-4 raised held-out greedy accuracy 0.28 -> 0.49 in 500 "
                   "iterations, decayed over 640 (0.46 at a constant 1e-4); 1.5e-4 learned slower, and at "
                   "temperature 1.0 4e-4 collapsed it (0.18 within 100 iterations), as did 2e-4 or 4 optimizer "
                   "steps per batch with 8 x 8.")
flags.DEFINE_float("critic_lr", 1e-3, "Critic learning rate (value head and critic adapter).")
flags.DEFINE_integer("warmup_iterations", 20, "Linear lr warm-up length in iterations (Adam's first steps move "
                     "every weight by about lr; warm-up keeps them small).", lower_bound=0)
flags.DEFINE_enum("lr_schedule", "linear", ("constant", "linear"), "After warm-up: linear decay to 0 at the last "
                  "iteration, or constant. On the tiny Arith policy (the default run) linear decay over 640 iterations "
                  "reached 0.487 held-out accuracy where a constant lr reached 0.459-0.463 (iterations 500-700). A run "
                  "resumed with another --num_env_steps goes on at the new budget's lr for the step it has "
                  "reached.")
flags.DEFINE_float("max_grad_norm", 1.0, "Gradient norm clip (0: off).")
flags.DEFINE_float("clip_param", 0.2, "PPO ratio clip epsilon.")
flags.DEFINE_float("entropy_coef", 0.0, "Entropy bonus coefficient.")
flags.DEFINE_float("target_kl", 0.0, "Stop the update early once a minibatch's approx KL to the behaviour policy "
                   "exceeds this (0: off).")

# --- Algorithm-specific ----------------------------------------------------------------------
flags.DEFINE_enum("critic", "auto", ("auto", "on", "off", "centralized", "per_role"), "Train a critic: auto = "
                  "APPO/TPPO yes, GRPO/RLOO no. On a multi-agent env (APPO/TPPO) it says what the critic reads: "
                  "centralized (= auto, on): the joint transcript (every message so far) and the acting role's name, "
                  "one value head (MAPPO); per_role: each role's own prompt, a value head per role.")
flags.DEFINE_float("value_coef", 0.5, "Value loss coefficient.")
flags.DEFINE_float("value_clip_param", 0.2, "Value clip around the collection-time values (0: off).")
flags.DEFINE_float("huber_delta", 0.0, "Huber delta of the value loss (0: squared error).")
flags.DEFINE_float("gamma", 1.0, "Discount across env steps.")
flags.DEFINE_float("gae_lambda", 0.95, "GAE lambda of the policy's advantages.")
flags.DEFINE_float("value_lambda", 1.0, "GAE lambda of the critic's targets (Decoupled GAE, as VAPO): 1.0 fits V "
                   "to the returns the rewards give; below 1 a token j steps before the reward sees it with weight "
                   "lambda^j and V is fitted mostly to its own later values.")
flags.DEFINE_enum("scale_rewards", "group", ("group", "batch", "none"), "Divide centred returns by the "
                  "group's std, the batch's, or nothing (Dr.GRPO).")
flags.DEFINE_float("kl_coef", 0.0, "k3 KL-to-reference coefficient (0: no reference pass).")
flags.DEFINE_enum("loss_agg", "token_mean", ("token_mean", "seq_mean"), "Per-token loss aggregation.")
flags.DEFINE_float("accuracy_lower_bound", 0.2, "PRIME: keep prompts whose group accuracy is >= this.")
flags.DEFINE_float("accuracy_upper_bound", 0.8, "PRIME: keep prompts whose group accuracy is <= this.")
flags.DEFINE_integer("oversample_factor", 4, "PRIME: sample this many times the prompts, keep "
                     "--n_rollout_threads / --group_size of those passing the filter. On the tiny policy (temperature "
                     "1.0, groups of 8) about a quarter of the groups pass [0.2, 0.8]: with 1, RLOO trained on "
                     "~16 of 64 samples per iteration and its training reward rose 0.152 -> 0.188 in 300 "
                     "iterations; with 4, 0.188 -> 0.261.", lower_bound=1)
flags.DEFINE_float("implicit_prm_beta", 0.05, "PRIME: implicit PRM beta.")
flags.DEFINE_float("implicit_prm_lr", 1e-3, "PRIME: implicit PRM learning rate. On the tiny Arith policy's "
                   "solutions (bench/implicit_prm_fit.py, one step per 64) its held-out ROC-AUC after 32 steps was "
                   "0.51 at 1e-5, 0.71 at 1e-4 and 0.76 at 1e-3 (0.67 after 4 steps); PRIME used 1e-6 on 7B models.")
flags.DEFINE_float("process_coef", 0.2, "PRIME: weight of the implicit-PRM reward stream (0: RLOO on the outcome "
                   "stream alone, and no implicit PRM is built or trained). On the tiny Arith policy (25,600 env "
                   "steps, 2 seeds, temperature 1.0, groups of 8) weight 1 (PRIME's) ended at 0.308 held-out "
                   "accuracy against 0.378 for the same sampling without the stream; 0.2 ended at 0.377.")

WITH_CRITIC = tuple(name for name, spec in ALGORITHMS.items() if spec.critic is not None)
APPLIES_TO = {
    **dict.fromkeys(("accuracy_lower_bound", "accuracy_upper_bound", "oversample_factor", "implicit_prm_beta",
                     "implicit_prm_lr", "process_coef"), ("RLOO",)),
    "scale_rewards": ("GRPO",),
    "kl_coef": ("GRPO", "TPPO", "RLOO"),
    **dict.fromkeys(("value_coef", "value_clip_param", "huber_delta", "gae_lambda", "value_lambda", "critic_lr"),
                    WITH_CRITIC),
}
"""Flags that only some algorithms read: passing one to another algorithm is an error rather than
silently ignored, and each one's help says which algorithms it applies to."""
for _name, _algorithms in APPLIES_TO.items():
    FLAGS[_name].help += f" [{'/'.join(_algorithms)} only]"


def _register_path(name: str, kind: str) -> None:
    """--name must be an existing ``kind`` ("file-or-dir", "dir", "checkpoint") when given ("checkpoint"
    also takes 'auto')."""
    def check(value: str | None) -> bool:
        if value is None or (kind == "file-or-dir" and value.startswith("hf://")) or (kind == "checkpoint"
                                                                                    and value == "auto"):
            return True
        path = Path(value).expanduser()
        if not path.exists():
            raise flags.ValidationError(f"{value!r} does not exist; pass an existing path or leave --{name} out")
        if kind == "dir" and not path.is_dir():
            raise flags.ValidationError(f"{value!r} is not a directory; pass a Hugging Face model directory")
        if kind == "checkpoint" and not (path / "manifest.json").is_file():
            raise flags.ValidationError(f"{value!r} has no manifest.json: pass 'auto' or a complete checkpoint "
                                        "directory written by this trainer (<logdir>/<experiment>/<run>/checkpoints/"
                                        "iter_N)")
        return True
    flags.register_validator(name, check)


for _name, _kind in (("dataset_path", "file-or-dir"), ("eval_dataset_path", "file-or-dir"),
                     ("model_name_or_path", "dir"), ("prm_model_name_or_path", "dir"),
                     ("prm_checkpoint_path", "dir"), ("target_model_name_or_path", "dir"), ("resume", "checkpoint")):
    _register_path(_name, _kind)


def _positive(name: str, allow_zero: bool = False) -> None:
    flags.register_validator(name, lambda v: v >= 0 if allow_zero else v > 0,
                             f"must be {'>= 0' if allow_zero else '> 0'}")


for _name in ("lr", "critic_lr", "clip_param", "temperature"):
    _positive(_name)
for _name in ("max_grad_norm", "entropy_coef", "target_kl", "value_coef", "value_clip_param", "huber_delta",
              "kl_coef", "implicit_prm_beta", "implicit_prm_lr", "process_coef"):
    _positive(_name, allow_zero=True)
flags.register_validator("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
flags.register_validator("gamma", lambda v: 0 <= v <= 1, "must be in [0, 1]")
for _name in ("gae_lambda", "value_lambda"):
    flags.register_validator(_name, lambda v: 0 <= v <= 1, "must be in [0, 1]")
flags.register_validator("device", lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v) is not None,
                         "must be auto, cpu, cuda or cuda:N")
flags.register_validator("experiment_name", lambda v: v is None or re.fullmatch(r"[\w.\-]+", v) is not None,
                         "must be letters, digits, '.', '-' or '_' (it names a directory)")


@flags.multi_flags_validator(["n_rollout_threads", "group_size", "algorithm_name"])
def _check_groups(f: dict) -> bool:
    threads, algorithm = f["n_rollout_threads"], f["algorithm_name"]
    group_size = f["group_size"] or default_group_size(algorithm)
    if threads % group_size:
        raise flags.ValidationError(f"--n_rollout_threads={threads} must be a multiple of --group_size={group_size}")
    if ALGORITHMS[algorithm].episodic and group_size < 2:
        raise flags.ValidationError(f"--algorithm_name={algorithm} compares samples within a prompt group: "
                                    f"--group_size={group_size} must be >= 2")
    return True


@flags.multi_flags_validator(["algorithm_name", "critic"])
def _check_critic(f: dict) -> bool:
    algorithm, critic = f["algorithm_name"], f["critic"]
    if has_critic(algorithm) and critic == "off":
        raise flags.ValidationError(f"--algorithm_name={algorithm} needs a critic (its advantages come from V); "
                                    "drop --critic=off or use GRPO/RLOO")
    if not has_critic(algorithm) and critic not in ("auto", "off"):
        raise flags.ValidationError(f"--algorithm_name={algorithm} is critic-free; drop --critic={critic} or use APPO/TPPO")
    return True


@flags.validator("generation_backend", "--generation_backend=vllm needs vLLM: pip install 'mathrl[vllm]' "
                 "(or use --generation_backend=hf)")
def _check_vllm(backend: str) -> bool:
    return backend != "vllm" or importlib.util.find_spec("vllm") is not None


@flags.multi_flags_validator(["data_parallel", "lora_rank"])
def _check_data_parallel(f: dict) -> bool:
    if f["data_parallel"] == "fsdp" and f["lora_rank"] > 0:
        raise flags.ValidationError(f"--data_parallel=fsdp shards full fine-tuning; with --lora_rank={f['lora_rank']} "
                                    "the adapters are small enough for every rank: use --data_parallel ddp (or auto)")
    return True


@flags.multi_flags_validator(["async_rollouts", "generation_backend"])
def _check_async_backend(f: dict) -> bool:
    if f["async_rollouts"] and f["generation_backend"] != "hf":
        raise flags.ValidationError("--async_rollouts generates with an HF copy of the policy; with "
                                    f"--generation_backend={f['generation_backend']} use --noasync_rollouts")
    return True


for _name in ("target_url", "prm_url", "vllm_url"):
    flags.register_validator(_name, lambda v: v is None or _valid_urls(v),
                             "must be http(s)://HOST:PORT[,http(s)://HOST:PORT...], e.g. http://127.0.0.1:8000")


def _valid_urls(value: str) -> bool:
    from models.remote import parse_urls

    try:
        parse_urls(value)
    except ValueError:
        return False
    return True


@flags.multi_flags_validator(["generation_backend", "vllm_url", "vllm_model_name", "vllm_sync_dir"])
def _check_vllm_server(f: dict) -> bool:
    if f["generation_backend"] == "vllm_server" and f["vllm_url"] is None:
        raise flags.ValidationError("--generation_backend=vllm_server needs --vllm_url (the server of the policy)")
    extra = [name for name in ("vllm_url", "vllm_model_name", "vllm_sync_dir") if f[name] is not None]
    if f["generation_backend"] != "vllm_server" and extra:
        raise flags.ValidationError(f"--{extra[0]} is for --generation_backend=vllm_server; add it or drop --{extra[0]}")
    return True


@flags.multi_flags_validator(["accuracy_lower_bound", "accuracy_upper_bound"])
def _check_accuracy_bounds(f: dict) -> bool:
    if not 0 <= f["accuracy_lower_bound"] <= f["accuracy_upper_bound"] <= 1:
        raise flags.ValidationError(f"need 0 <= --accuracy_lower_bound ({f['accuracy_lower_bound']}) <= "
                                    f"--accuracy_upper_bound ({f['accuracy_upper_bound']}) <= 1")
    return True


@flags.multi_flags_validator(["reward", "prm_model_name_or_path", "prm_url", "prm_model_name",
                              "target_model_name_or_path", "target_url", "target_model_name", "prm_checkpoint_path"])
def _check_reward(f: dict) -> bool:
    with_prm = f["prm_model_name_or_path"] is not None or f["prm_url"] is not None
    spec = f["reward"] or (DEFAULT_PRM_REWARD if with_prm else "outcome")
    names = reward_sources(spec)
    for source, where in (("prm", ("prm_model_name_or_path", "prm_url")),
                          ("target", ("target_model_name_or_path", "target_url"))):
        given = [name for name in where if f[name] is not None]
        if source in names and not given:
            raise flags.ValidationError(f"--reward uses {source!r} but neither --{where[0]} nor --{where[1]} is given")
        if len(given) == 2:
            raise flags.ValidationError(f"--{where[0]} runs the {source} here and --{where[1]} on a server: give one")
        if given and source not in names:
            raise flags.ValidationError(f"--{given[0]} is given but --reward={spec!r} does not use "
                                        f"{source!r}; add it (e.g. '{source}:0.2') or drop --{given[0]}")
        if f[f"{source}_model_name"] is not None and f[where[1]] is None:
            raise flags.ValidationError(f"--{source}_model_name names the model served at --{where[1]}; add "
                                        f"--{where[1]} or drop it")
    if f["prm_checkpoint_path"] is not None and f["prm_model_name_or_path"] is None:
        raise flags.ValidationError("--prm_checkpoint_path is an adapter for a local PRM: give --prm_model_name_or_path "
                                    "(a PRM server applies its own adapter)")
    return True


@flags.multi_flags_validator(["reward", "dataset_path"])
def _check_steps_reward(f: dict) -> bool:
    if f["reward"] is not None and "steps" in reward_sources(f["reward"]) and f["dataset_path"] is not None:
        raise flags.ValidationError("--reward uses 'steps', which pays the share of a canonical step-by-step solution "
                                    "reproduced exactly: only Arith's generated problems have one (MATH solutions "
                                    "are prose, so it would pay 0). Drop 'steps' or drop --dataset_path")
    return True


@flags.multi_flags_validator(["handoff_steps", "reward", "target_model_name_or_path", "action_level"])
def _check_handoff(f: dict) -> bool:
    if f["handoff_steps"] is None:
        return True
    if f["reward"] is None or "target" not in reward_sources(f["reward"]):
        raise flags.ValidationError("--handoff_steps hands the prefix to the frozen target: add 'target' to --reward "
                                    "(e.g. --reward target) and --target_model_name_or_path or --target_url")
    if f["action_level"] == "token":
        raise flags.ValidationError("--handoff_steps counts actions; with --action_level token use --action_level "
                                    "solution and --max_new_tokens for a prefix of at most that many tokens")
    if f["action_level"] == "solution" and f["handoff_steps"] != 1:
        raise flags.ValidationError(f"--handoff_steps={f['handoff_steps']}: with --action_level solution an episode "
                                    "is one action; use --handoff_steps 1, or --action_level step for a prefix of "
                                    "several steps")
    return True


@flags.multi_flags_validator(["prm_kv_cache_mb", "prm_type"])
def _check_prm_kv_cache(f: dict) -> bool:
    if f["prm_kv_cache_mb"] and PRM_TYPES[f["prm_type"].lower()] != "shepherd":
        raise flags.ValidationError(f"--prm_kv_cache_mb={f['prm_kv_cache_mb']} needs --prm_type=shepherd; "
                                    f"--prm_type={f['prm_type']} always recomputes (drop the flag or pass 0)")
    return True


@flags.multi_flags_validator(["env_id", "dataset_path", "dataset_name"])
def _check_env_source(f: dict) -> bool:
    env_name = (f["env_id"] or "").rpartition(":")[2]
    if env_name.startswith("Arith") and f["dataset_path"] is not None:
        raise flags.ValidationError(f"--env_id={f['env_id']} generates its problems; drop --dataset_path or use "
                                    "--env_id=MATH-v0")
    if env_name.startswith("MATH") and f["dataset_path"] is None:
        raise flags.ValidationError(f"--env_id={f['env_id']} needs --dataset_path (e.g. ../shared/data/math500.jsonl)")
    if f["dataset_name"] is not None and f["dataset_path"] is None:
        raise flags.ValidationError("--dataset_name filters a MATH dataset's subjects: give --dataset_path too")
    return True


def reward_sources(spec: str) -> list[str]:
    """Source names of a --reward spec (validated fully by reward_models.mixture.parse_reward_spec)."""
    from reward_models.mixture import parse_reward_spec

    if "implicit_prm" in spec:
        raise flags.ValidationError("'implicit_prm' is not a --reward source: PRIME's implicit PRM is RLOO's second "
                                    "reward stream; use --algorithm_name RLOO (--process_coef weighs it)")
    try:
        return list(parse_reward_spec(spec, REWARD_SOURCES))
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None


def check_algorithm_specific(flag_values: flags.FlagValues = FLAGS) -> None:
    """Flags the chosen algorithm would ignore must not be passed (``APPLIES_TO``)."""
    algorithm = flag_values.algorithm_name
    for name, algorithms in APPLIES_TO.items():
        if algorithm not in algorithms and flag_values[name].present:
            raise flags.ValidationError(f"--{name} applies to {'/'.join(algorithms)}; --algorithm_name={algorithm} "
                                        f"would ignore it. Drop it or use --algorithm_name={algorithms[0]}")
    if flag_values["max_policy_lag"].present and not resolved_async_rollouts(flag_values):
        raise flags.ValidationError("--max_policy_lag bounds asynchronous rollouts; add --async_rollouts or drop it")


def has_critic(algorithm: str) -> bool:
    return ALGORITHMS[algorithm].critic is not None


def default_group_size(algorithm: str) -> int:
    return 4 if ALGORITHMS[algorithm].episodic else 1


def resolved_group_size(flag_values: flags.FlagValues = FLAGS) -> int:
    if flag_values.group_size is not None:
        return flag_values.group_size
    return default_group_size(flag_values.algorithm_name)


def resolved_env_id(flag_values: flags.FlagValues = FLAGS) -> str:
    if flag_values.env_id is not None:
        return flag_values.env_id
    return "MATH-v0" if flag_values.dataset_path is not None else "Arith-v0"


def registered_env_id(flag_values: flags.FlagValues = FLAGS) -> str:
    """The gymnasium id of --env_id, after importing ``module`` of ``module:EnvId``; it must be registered
    with a vector entry point taking ``group_size`` (MathVectorEnv or compatible)."""
    import gymnasium  # here, not at the top: parsing flags stays light

    import envs  # noqa: F401  (registers the built-in ids)

    env_id = resolved_env_id(flag_values)
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise flags.ValidationError(f"--env_id={env_id}: cannot import registration module {module!r}: {error}")
    if name not in gymnasium.registry:
        known = ", ".join(sorted(k for k in gymnasium.registry if k.startswith(("MATH", "Arith"))))
        raise flags.ValidationError(f"--env_id={env_id}: {name!r} is not a registered gymnasium id (built in: {known}); "
                                    "use 'module:EnvId' to import the module that registers it")
    if gymnasium.spec(name).vector_entry_point is None:
        raise flags.ValidationError(f"--env_id={env_id} has no vector_entry_point; the trainer needs a batched env "
                                    "like envs.vector:MathVectorEnv (register one with vector_entry_point=...)")
    return name


def workflow_of(flag_values: flags.FlagValues = FLAGS):
    """The ``envs.workflows.Workflow`` of a multi-agent --env_id (registered with ``workflow=``), else None."""
    import gymnasium

    from envs.workflows import resolve_workflow

    workflow = gymnasium.spec(registered_env_id(flag_values)).kwargs.get("workflow")
    return None if workflow is None else resolve_workflow(workflow)


def check_multi_agent(flag_values: flags.FlagValues = FLAGS) -> None:
    """What a multi-agent env (every action a whole message, credit by --reward_assignment, the other --reward
    sources on answering roles' messages) rules out."""
    f = flag_values
    workflow = workflow_of(f)
    if workflow is None:
        for name in ("reward_assignment", "role_model", "share_policy", "agent_groups"):
            if f[name].present:
                raise flags.ValidationError(f"--{name} concerns the roles of a multi-agent env; --env_id={f.env_id} "
                                            "has one agent (use e.g. --env_id Arith-Chain-v0, or drop it)")
        if f.critic in ("centralized", "per_role"):
            raise flags.ValidationError(f"--critic={f.critic} concerns the roles of a multi-agent env; --env_id={f.env_id} "
                                        "has one agent (use --critic on, or e.g. --env_id Arith-Chain-v0)")
        return
    if not f.share_policy and f.lora_rank == 0:
        raise flags.ValidationError("--noshare_policy gives each role a LoRA adapter on the shared base: add "
                                    "--lora_rank > 0 (now 0)")
    frozen = [role.name for role in workflow.roles if not role.trainable]
    for role in role_models(f):
        if role not in frozen:
            raise flags.ValidationError(f"--role_model {role}=...: the frozen roles of --env_id={f.env_id} are "
                                        f"{frozen or 'none'}; a trained role speaks with the policy")
    if f.action_level != "solution":
        raise flags.ValidationError(f"--action_level={f.action_level}: in the multi-agent --env_id={f.env_id} every "
                                    "action is one role's whole message; use --action_level solution")
    if f["handoff_steps"].present:
        raise flags.ValidationError(f"--handoff_steps with the multi-agent --env_id={f.env_id}: Prefix-RL is "
                                    "Arith-Prefix-v0 there (its solver role finishes the writer's prefix)")
    sources = reward_sources(resolved_reward(f))
    if "outcome" not in sources:
        raise flags.ValidationError(f"--reward={resolved_reward(f)!r} with the multi-agent --env_id={f.env_id}: its "
                                    "'outcome' source is the --reward_assignment credit, which every role needs; "
                                    "add it, e.g. --reward outcome:1.0,prm:0.2")
    if "target" in sources and any(role.continues for role in workflow.roles):
        continuing = next(role.name for role in workflow.roles if role.continues)
        raise flags.ValidationError(f"--reward uses 'target' with --env_id={f.env_id}, whose {continuing} role already "
                                    "is the frozen target finishing the prefix; drop 'target' from --reward and give "
                                    f"the target as --role_model {continuing}=DIR")


def role_models(flag_values: flags.FlagValues = FLAGS) -> dict[str, str]:
    """--role_model entries as {role: model directory}."""
    models = {}
    for entry in flag_values.role_model:
        role, sep, directory = entry.partition("=")
        if not sep or not role or not directory:
            raise flags.ValidationError(f"--role_model={entry!r} must be ROLE=DIR (e.g. solver=/models/target)")
        models[role] = directory
    return models


def reward_weights(flag_values: flags.FlagValues = FLAGS) -> dict[str, float]:
    """{source: weight} of --reward (or its default)."""
    from reward_models.mixture import parse_reward_spec

    return parse_reward_spec(resolved_reward(flag_values), REWARD_SOURCES)


def resolved_reward(flag_values: flags.FlagValues = FLAGS) -> str:
    if flag_values.reward is not None:
        return flag_values.reward
    with_prm = flag_values.prm_model_name_or_path is not None or flag_values.prm_url is not None
    return DEFAULT_PRM_REWARD if with_prm else "outcome"


def whole_episodes(flag_values: flags.FlagValues = FLAGS) -> bool:
    """Whether each iteration collects whole episodes (no autoreset): episodic algorithms, and every
    algorithm on a multi-agent env (an agent bootstraps from its own next turn in the same rollout)."""
    return ALGORITHMS[flag_values.algorithm_name].episodic or workflow_of(flag_values) is not None


def value_heads(flag_values: flags.FlagValues = FLAGS) -> int:
    """The policy's value-head outputs: one per role for --critic per_role on a multi-agent env, else 1."""
    workflow = workflow_of(flag_values)
    return len(workflow.roles) if workflow is not None and flag_values.critic == "per_role" else 1


def critic_view(flag_values: flags.FlagValues = FLAGS) -> str:
    """What a multi-agent env's critic reads: "per_role" (its own prompt) or "centralized" (the joint transcript)."""
    return "per_role" if flag_values.critic == "per_role" else "centralized"


def resolved_episode_length(flag_values: flags.FlagValues = FLAGS) -> int:
    if flag_values.episode_length is not None:
        return flag_values.episode_length
    workflow = workflow_of(flag_values)
    if workflow is not None:
        import gymnasium

        return workflow.max_turns or gymnasium.spec(registered_env_id(flag_values)).kwargs.get("max_steps", 8)
    return 1 if flag_values.action_level == "solution" else 8


def num_train_envs(flag_values: flags.FlagValues = FLAGS) -> int:
    """Envs stepped per iteration: --n_rollout_threads, times RLOO's oversampling."""
    oversample = flag_values.oversample_factor if flag_values.algorithm_name == "RLOO" else 1
    return flag_values.n_rollout_threads * oversample


def resolved_num_iterations(flag_values: flags.FlagValues = FLAGS) -> int:
    """ceil(--num_env_steps / the most env steps an iteration takes)."""
    per_iteration = resolved_episode_length(flag_values) * num_train_envs(flag_values)
    return -(-flag_values.num_env_steps // per_iteration)


def resolved_async_rollouts(flag_values: flags.FlagValues = FLAGS) -> bool:
    if flag_values.async_rollouts is not None:
        return flag_values.async_rollouts
    if flag_values.generation_backend != "hf":
        return False
    return flag_values.algorithm_name == "APPO" or _runs_on_cpu(flag_values.device)


def _runs_on_cpu(device: str) -> bool:
    """Whether ``--device`` resolves to the CPU, where a second thread has a core of its own (on one GPU
    the copy's memory would buy little overlap)."""
    if device == "auto":
        import torch  # here, not at the top: parsing and validating flags stays light

        return not torch.cuda.is_available()
    return device == "cpu"


def resolved_experiment_name(flag_values: flags.FlagValues = FLAGS) -> str:
    if flag_values.experiment_name is not None:
        return flag_values.experiment_name
    return f"{flag_values.algorithm_name}_{resolved_env_id(flag_values).rpartition(':')[2]}"


def resolved_prm_type(flag_values: flags.FlagValues = FLAGS) -> str:
    return PRM_TYPES[flag_values.prm_type.lower()]


def inherit(saved: dict, flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Resuming: every flag not given on this command line takes its value in the checkpoint's ``saved``
    flags (a ``flag_dict``), so a resumed run trains as the run it continues unless told otherwise.
    Returns the names whose value changed; the flags are validated again."""
    inherited = []
    for name, value in saved.items():
        if name == "resume" or name not in flag_values or flag_values[name].present:
            continue
        if flag_values[name].value != value:
            flag_values[name].value = value
            inherited.append(name)
    flag_values.validate_all_flags()
    return inherited


def flag_dict(flag_values: flags.FlagValues = FLAGS) -> dict:
    """{name: value} of every flag this module defines (for TensorBoard text and hparams)."""
    return {f.name: f.value for f in sorted(flag_values.get_flags_for_module(__name__), key=lambda f: f.name)}
