"""Validators of the flags, run by absl at parse time before anything heavy is imported.

Each names the flag and the fix. Flags that only some algorithms read are refused for the others
(``APPLIES_TO``) instead of silently ignored; checks that need resolved values (the env's workflow,
asynchronous rollouts) run in ``train.resolve.config_from_flags``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from absl import flags

from algorithms.registry import ALGORITHMS
from envs.modes import DType, PrmType
from train.config import DEFAULT_PRM_REWARD, FLOAT16_TRAINING, PRM_TYPE_ALIASES, REWARD_SOURCES, parse_eval_sets

FLAGS = flags.FLAGS

WITH_CRITIC = tuple(name for name, spec in ALGORITHMS.items() if spec.critic is not None)
CRITIC_FREE = tuple(name for name, spec in ALGORITHMS.items() if spec.critic is None)
GROUPED = tuple(name for name, spec in ALGORITHMS.items() if spec.grouped)
TOKEN_LOSS = tuple(name for name in ALGORITHMS if name != "APPO")  # APPO's loss is one ratio per action
APPLIES_TO = {
    **dict.fromkeys(("accuracy_lower_bound", "accuracy_upper_bound", "oversample_factor", "implicit_prm_beta",
                     "implicit_prm_lr", "process_coef", "prime_update", "prime_norm", "normalize_advantages"),
                    ("RLOO",)),
    "scale_rewards": ("GRPO",),
    "agent_groups": GROUPED,
    "importance_sampling_level": CRITIC_FREE,
    **dict.fromkeys(("kl_coef", "kl_loss_type", "use_kl_in_reward", "kl_penalty", "loss_agg_mode",
                     "loss_scale_factor"), TOKEN_LOSS),
    **dict.fromkeys(("value_coef", "value_clip_param", "huber_delta", "gae_lambda", "value_lambda", "critic_lr"),
                    WITH_CRITIC),
}
"""Flags that only some algorithms read: passing one to another algorithm is an error rather than
silently ignored, and each one's help says which algorithms it applies to."""
for _name, _algorithms in APPLIES_TO.items():
    FLAGS[_name].help += f" [{'/'.join(_algorithms)} only]"


def _register_path(name: str, kind: str) -> None:
    """--name must be an existing ``kind`` when given: "data" (a file or directory, or hf://NAME with the
    datasets package installed), "model" (a directory, or a hub id resolved later), "dir", or "checkpoint"
    (a checkpoint directory, or 'auto')."""
    flags.register_validator(name, lambda value: _check_path(name, kind, value))


def _check_path(name: str, kind: str, value: str | None) -> bool:
    """True if ``value`` of --name is an existing ``kind`` (see ``_register_path``) or None; else raises."""
    if value is None or (kind == "checkpoint" and value == "auto"):
        return True
    if kind == "data" and value.startswith("hf://"):
        return _check_hub_dataset(value)
    path = Path(value).expanduser()
    if kind == "model" and not path.exists() and looks_like_hub_id(value):
        return True
    if not path.exists():
        raise flags.ValidationError(f"{value!r} does not exist; pass an existing path or leave --{name} out")
    if kind in ("dir", "model") and not path.is_dir():
        raise flags.ValidationError(f"{value!r} is not a directory; pass a Hugging Face model directory")
    if kind == "checkpoint" and not (path / "manifest.json").is_file():
        raise flags.ValidationError(f"{value!r} has no manifest.json: pass 'auto' or a complete checkpoint "
                                    "directory written by this trainer (<logdir>/<experiment>/<run>/checkpoints/"
                                    "iter_N)")
    return True


def looks_like_hub_id(value: str) -> bool:
    """Whether ``value`` has a hub id's shape, NAME or ORG/NAME (a missing relative path of at most two parts
    has it too; resolving it then says it is neither)."""
    return re.fullmatch(r"[\w\-.]+(/[\w\-.]+)?", value) is not None and not value.startswith((".", "-"))


def _check_hub_dataset(value: str) -> bool:
    if importlib.util.find_spec("datasets") is None:
        raise flags.ValidationError(f"{value!r} is a Hugging Face hub dataset, which needs the datasets package: "
                                    "pip install datasets (or pass a local JSONL file)")
    return True


for _name, _kind in (("dataset_path", "data"), ("model_name_or_path", "model"),
                     ("prm_model_name_or_path", "model"), ("prm_checkpoint_path", "dir"),
                     ("target_model_name_or_path", "model"), ("resume", "checkpoint")):
    _register_path(_name, _kind)


def _check_eval_sets(value: str | None) -> bool:
    try:
        sets = parse_eval_sets(value)
    except ValueError as error:
        raise flags.ValidationError(str(error)) from None
    return all(_check_path("eval_dataset_path", "data", eval_set.path) for eval_set in sets)


flags.register_validator("eval_dataset_path", _check_eval_sets)


def _positive(name: str, allow_zero: bool = False) -> None:
    flags.register_validator(name, lambda v: v >= 0 if allow_zero else v > 0,
                             f"must be {'>= 0' if allow_zero else '> 0'}")


for _name in ("lr", "critic_lr", "clip_param", "temperature", "eval_temperature"):
    _positive(_name)
for _name in ("max_grad_norm", "entropy_coef", "target_kl", "value_coef", "value_clip_param", "huber_delta",
              "kl_coef", "implicit_prm_beta", "implicit_prm_lr", "process_coef"):
    _positive(_name, allow_zero=True)
for _name in ("top_p", "eval_top_p"):
    flags.register_validator(_name, lambda v: 0 < v <= 1, "must be in (0, 1]")
flags.register_validator("gamma", lambda v: 0 <= v <= 1, "must be in [0, 1]")
for _name in ("gae_lambda", "value_lambda"):
    flags.register_validator(_name, lambda v: 0 <= v <= 1, "must be in [0, 1]")
flags.register_validator("device", lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v) is not None,
                         "must be auto, cpu, cuda or cuda:N")
flags.register_validator("dtype", lambda v: v != DType.FLOAT16, FLOAT16_TRAINING)
flags.register_validator("experiment_name", lambda v: v is None or re.fullmatch(r"[\w.\-]+", v) is not None,
                         "must be letters, digits, '.', '-' or '_' (it names a directory)")


@flags.multi_flags_validator(["n_rollout_threads", "group_size", "algorithm_name"])
def _check_groups(f: dict) -> bool:
    threads, algorithm = f["n_rollout_threads"], f["algorithm_name"]
    group_size = f["group_size"] or default_group_size(algorithm)
    if threads % group_size:
        raise flags.ValidationError(f"--n_rollout_threads={threads} must be a multiple of --group_size={group_size}")
    if ALGORITHMS[algorithm].grouped and group_size < 2:
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
        raise flags.ValidationError(f"--algorithm_name={algorithm} is critic-free; drop --critic={critic} "
                                    "or use APPO/TPPO")
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


for _name in ("target_url", "prm_url", "vllm_url", "tool_url"):
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
        raise flags.ValidationError(f"--{extra[0]} is for --generation_backend=vllm_server; "
                                    f"add it or drop --{extra[0]}")
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
        raise flags.ValidationError("--prm_checkpoint_path is an adapter for a local PRM: "
                                    "give --prm_model_name_or_path (a PRM server applies its own adapter)")
    return True


@flags.multi_flags_validator(["reward", "dataset_path", "env_id"])
def _check_steps_reward(f: dict) -> bool:
    on_math = f["dataset_path"] is not None or (f["env_id"] or "").rpartition(":")[2].startswith("MATH")
    if f["reward"] is not None and "steps" in reward_sources(f["reward"]) and on_math:
        raise flags.ValidationError("--reward uses 'steps', which pays the share of a canonical step-by-step solution "
                                    "reproduced exactly: only Arith's generated problems have one (MATH solutions "
                                    "are prose, so it would pay 0). Drop 'steps' or use an Arith env")
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
    prm_type = f["prm_type"].lower()
    if f["prm_kv_cache_mb"] and PRM_TYPE_ALIASES.get(prm_type, prm_type) != PrmType.SHEPHERD:
        raise flags.ValidationError(f"--prm_kv_cache_mb={f['prm_kv_cache_mb']} needs --prm_type=shepherd; "
                                    f"--prm_type={f['prm_type']} always recomputes (drop the flag or pass 0)")
    return True


@flags.multi_flags_validator(["env_id", "dataset_path", "dataset_name"])
def _check_env_source(f: dict) -> bool:
    env_name = (f["env_id"] or "").rpartition(":")[2]
    if env_name.startswith("Arith") and f["dataset_path"] is not None:
        raise flags.ValidationError(f"--env_id={f['env_id']} generates its problems; drop --dataset_path or use "
                                    "--env_id=MATH-v0")
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


def has_critic(algorithm: str) -> bool:
    return ALGORITHMS[algorithm].critic is not None


def kl_in_reward(use_kl_in_reward: bool | None, algorithm: str) -> bool:
    """--use_kl_in_reward, or its default: on for REINFORCE++ (its KL is a token reward), else off."""
    return algorithm.startswith("REINFORCE_PP") if use_kl_in_reward is None else use_kl_in_reward


@flags.multi_flags_validator(["clip_ratio_low", "clip_ratio_high", "clip_ratio_c"])
def _check_clip_ratios(f: dict) -> bool:
    if f["clip_ratio_low"] is not None and not 0 <= f["clip_ratio_low"] < 1:
        raise flags.ValidationError(f"--clip_ratio_low={f['clip_ratio_low']} must be in [0, 1): the ratio's floor is "
                                    "1 - clip_ratio_low")
    if f["clip_ratio_high"] is not None and f["clip_ratio_high"] < 0:
        raise flags.ValidationError(f"--clip_ratio_high={f['clip_ratio_high']} must be >= 0")
    if f["clip_ratio_c"] is not None and f["clip_ratio_c"] <= 1:
        raise flags.ValidationError(f"--clip_ratio_c={f['clip_ratio_c']} must be > 1: it bounds the loss of a negative "
                                    "advantage at c |A|, above the clipped ratio's (verl uses 3.0); "
                                    "leave it out for off")
    return True


@flags.multi_flags_validator(["kl_coef", "kl_loss_type", "use_kl_in_reward", "kl_penalty", "algorithm_name"])
def _check_kl(f: dict) -> bool:
    in_reward = kl_in_reward(f["use_kl_in_reward"], f["algorithm_name"])
    given = [name for name in ("kl_loss_type", "use_kl_in_reward", "kl_penalty") if FLAGS[name].present]
    if given and f["kl_coef"] == 0:
        raise flags.ValidationError(f"--{given[0]} sets the KL to the reference, but --kl_coef is 0 (no KL); add "
                                    "--kl_coef > 0 or drop it")
    if FLAGS["kl_penalty"].present and not in_reward:
        raise flags.ValidationError("--kl_penalty is the estimator of the KL in the reward; add --use_kl_in_reward, "
                                    "or set the loss's estimator with --kl_loss_type")
    if FLAGS["kl_loss_type"].present and in_reward:
        raise flags.ValidationError("--kl_loss_type is the estimator of the KL in the loss, and the KL is in the "
                                    f"reward (--use_kl_in_reward, default with {f['algorithm_name']}); "
                                    "use --kl_penalty, or --nouse_kl_in_reward")
    return True


@flags.multi_flags_validator(["loss_scale_factor", "loss_agg_mode"])
def _check_loss_scale_factor(f: dict) -> bool:
    if f["loss_scale_factor"] is not None and f["loss_agg_mode"] != "seq-mean-token-sum-norm":
        raise flags.ValidationError(f"--loss_scale_factor divides seq-mean-token-sum-norm's token sums; with "
                                    f"--loss_agg_mode={f['loss_agg_mode']} drop it (or use that mode, Dr. GRPO)")
    return True


def default_group_size(algorithm: str) -> int:
    return 4 if ALGORITHMS[algorithm].episodic else 1


@flags.multi_flags_validator(["prompt_template", "answer_instruction"])
def _check_answer_instruction(f: dict) -> bool:
    if f["answer_instruction"] and FLAGS["answer_instruction"].present and f["prompt_template"] != "chat":
        raise flags.ValidationError("--answer_instruction ends the user turn of --prompt_template chat; add it, or "
                                    "write the instruction into --system_prompt (qwen_math) instead")
    return True


@flags.multi_flags_validator(["prompt_template", "system_prompt"])
def _check_system_prompt(f: dict) -> bool:
    if f["system_prompt"] is not None and f["prompt_template"] == "default":
        raise flags.ValidationError("--system_prompt needs a chat prompt template: add --prompt_template chat (the "
                                    "tokenizer's own) or qwen_math; the default plain template has no system turn")
    return True


def _given(name: str) -> bool:
    return FLAGS[name].present


@flags.multi_flags_validator(["filter_groups", "max_num_gen_batches", "oversample_factor", "algorithm_name"])
def _check_filter_groups(f: dict) -> bool:
    if _given("max_num_gen_batches") and not f["filter_groups"]:
        raise flags.ValidationError("--max_num_gen_batches bounds the rounds of --filter_groups; add --filter_groups "
                                    "or drop it")
    if f["filter_groups"] and not ALGORITHMS[f["algorithm_name"]].episodic:
        raise flags.ValidationError(f"--filter_groups keeps prompt groups of varied returns; --algorithm_name="
                                    f"{f['algorithm_name']} collects no groups: use GRPO or RLOO")
    if f["filter_groups"] and f["algorithm_name"] == "RLOO" and f["oversample_factor"] > 1:
        raise flags.ValidationError(f"--filter_groups refills the batch with groups that have signal; RLOO's "
                                    f"--oversample_factor={f['oversample_factor']} selects them a second way: pass "
                                    "--oversample_factor 1")
    return True


@flags.multi_flags_validator(["overlong_buffer", "overlong_buffer_len", "overlong_penalty_factor",
                              "mask_truncated_completions", "max_new_tokens", "action_level"])
def _check_cut_off_answers(f: dict) -> bool:
    for name in ("overlong_buffer_len", "overlong_penalty_factor"):
        if _given(name) and not f["overlong_buffer"]:
            raise flags.ValidationError(f"--{name} shapes the penalty of --overlong_buffer; add --overlong_buffer or "
                                        "drop it")
    for name in ("overlong_buffer", "mask_truncated_completions"):
        if f[name] and f["action_level"] == "token":
            raise flags.ValidationError(f"--{name} concerns actions cut at --max_new_tokens; with --action_level token "
                                        "every action is one token: use --action_level solution or step")
    if f["overlong_buffer"] and f["overlong_buffer_len"] > f["max_new_tokens"]:
        raise flags.ValidationError(f"--overlong_buffer_len={f['overlong_buffer_len']} is longer than "
                                    f"--max_new_tokens={f['max_new_tokens']}; the buffer lies before the limit")
    return True


@flags.multi_flags_validator(["rollout_is", "rollout_is_threshold", "rollout_is_threshold_lower", "rollout_is_level",
                              "rollout_is_mode", "algorithm_name"])
def _check_rollout_is(f: dict) -> bool:
    for name in ("rollout_is_threshold", "rollout_is_threshold_lower", "rollout_is_level", "rollout_is_mode"):
        if _given(name) and not f["rollout_is"]:
            raise flags.ValidationError(f"--{name} sets how --rollout_is corrects; add --rollout_is or drop it")
    upper, lower = f["rollout_is_threshold"], f["rollout_is_threshold_lower"]
    if upper < 1:
        raise flags.ValidationError(f"--rollout_is_threshold={upper} < 1 would cut the weight of an on-policy token "
                                    "(ratio 1); use a value >= 1 (TIS: 2)")
    if lower is not None and f["rollout_is_mode"] != "mask":
        raise flags.ValidationError("--rollout_is_threshold_lower is the band's lower end of --rollout_is_mode mask; "
                                    "add it or drop the flag")
    if lower is not None and not 0 < lower <= 1:
        raise flags.ValidationError(f"--rollout_is_threshold_lower={lower} must be in (0, 1] (the band holds ratio 1)")
    if f["rollout_is"] and f["rollout_is_mode"] == "truncate" and f["algorithm_name"] == "APPO":
        raise flags.ValidationError("--rollout_is_mode truncate weights each token's policy gradient; APPO's loss "
                                    "takes one ratio per action: use --rollout_is_mode mask (or GRPO/RLOO/TPPO)")
    if f["rollout_is_mode"] == "mask" and f["rollout_is_level"] == "token":
        raise flags.ValidationError("--rollout_is_mode mask drops whole actions: use --rollout_is_level sequence or "
                                    "geometric (token-level ratios: --rollout_is_mode truncate)")
    return True
