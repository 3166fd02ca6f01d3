"""Every check of a run's options, against their choices, the machine and each other, in one place.

``validate(config)`` refuses a RunConfig built in code exactly as one built from flags: ``train.resolve.resolved``
runs it for both, before any option is resolved or any model loaded. Each check raises a ValueError of one line
naming the option in its flag's spelling (a field and its flag share the name, or ``option(flag=...)`` gives it),
the bad value and the fix.

An option counts as given when its value differs from its default (the one thing a config built in code can
say), or, for an option left to be resolved, from the value it resolves to. Options that only some algorithms
read (``APPLIES_TO``, from the traits of ``algorithms.registry``) are refused for the others instead of being
silently ignored; no algorithm is named here, only traits.

Light on purpose: the command line validates before torch is imported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

from algorithms.config import kl_in_reward
from algorithms.registry import ALGORITHMS, algorithms_with
from envs.modes import (ActionLevel, AgentGroups, Backend, Critic, DataParallel, DType, LossAgg, PrmType,
                        ProcessCredit, PromptTemplate, RolloutIsLevel, RolloutIsMode, RolloutMode)
from train.config import DEFAULT_PRM_REWARD, FLOAT16_TRAINING, REWARD_SOURCES, RunConfig, parse_eval_sets, sections
from algorithms.options import flag_name, options
from train.options import with_members

OPTIONS = {flag_name(field): (section, field) for section, kind in sections().items() for field in options(kind)}
"""{flag name: (RunConfig section, its field)} of every option."""

APPLIES_TO = {
    **dict.fromkeys(("accuracy_lower_bound", "accuracy_upper_bound", "filter_truncated", "oversample_factor",
                     "implicit_prm_beta", "implicit_prm_lr", "implicit_prm_grad_clip", "implicit_prm_num_mini_batch",
                     "process_coef", "prime_update", "prime_norm", "normalize_advantages", "implicit_prm_heldout_all",
                     "process_credit_assignment", "min_form_temperature", "prime_granularity",
                     "reward_baseline"),
                    algorithms_with(lambda spec: spec.prime)),
    "scale_rewards": algorithms_with(lambda spec: spec.scales_rewards),
    "agent_groups": algorithms_with(lambda spec: spec.grouped),
    "importance_sampling_level": algorithms_with(lambda spec: spec.critic is None),
    **dict.fromkeys(("kl_coef", "kl_loss_type", "use_kl_in_reward", "kl_penalty", "loss_agg_mode",
                     "loss_scale_factor"), algorithms_with(lambda spec: spec.token_loss)),
    **dict.fromkeys(("value_coef", "value_clip_param", "huber_delta", "gae_lambda", "value_lambda", "critic_lr"),
                    algorithms_with(lambda spec: spec.critic is not None)),
}
"""Options that only some algorithms read: {flag name: the algorithms that read it}."""

POSITIVE = ("lr", "critic_lr", "clip_param", "temperature", "eval_temperature", "implicit_prm_grad_clip")
NON_NEGATIVE = ("max_grad_norm", "entropy_coef", "target_kl", "value_coef", "value_clip_param", "huber_delta",
                "kl_coef", "implicit_prm_beta", "implicit_prm_lr", "process_coef")
PROBABILITIES = ("top_p", "eval_top_p")  # in (0, 1]: a nucleus holds some mass
FRACTIONS = ("gamma", "gae_lambda", "value_lambda")  # in [0, 1]
PATHS = {"dataset_path": "data", "model_name_or_path": "model", "prm_model_name_or_path": "model",
         "prm_checkpoint_path": "dir", "target_model_name_or_path": "model", "resume": "checkpoint"}
"""{flag name: what its value must be} (see ``check_path``)."""
SERVICE_URLS = ("target_url", "prm_url", "vllm_url", "tool_url")
VLLM_SERVER_OPTIONS = ("vllm_url", "vllm_model_name", "vllm_sync_dir")


def value(config: RunConfig, name: str) -> Any:
    """The value of the option whose flag is ``name``."""
    section, field = OPTIONS[name]
    return getattr(getattr(config, section), field.name)


def given(config: RunConfig, name: str) -> bool:
    """Whether the option whose flag is ``name`` differs from its default (and from what it resolves to)."""
    if name == "use_kl_in_reward":  # resolved to the algorithm's default; given when it says otherwise
        return config.learning.use_kl_in_reward not in (None, kl_in_reward(None, config.learning.algorithm))
    return value(config, name) != OPTIONS[name][1].default


def reward_sources(spec: str) -> list[str]:
    """Source names of a --reward spec (validated fully by reward_models.mixture.parse_reward_spec)."""
    from reward_models.mixture import parse_reward_spec

    if "implicit_prm" in spec:
        raise ValueError("'implicit_prm' is not a --reward source: PRIME's implicit PRM is a second reward stream; "
                         f"use --algorithm_name {'/'.join(algorithms_with(lambda spec: spec.prime))} (--process_coef "
                         "weighs it)")
    return list(parse_reward_spec(spec, REWARD_SOURCES))


def checked_modes(config: RunConfig) -> RunConfig:
    """``config`` with every mode (an Enum option: --dtype, --loss_agg_mode, --critic, ...) as its Enum's
    member, a string among its choices included, so the layers below compare members only; float16 training
    refused (``FLOAT16_TRAINING``), a grader whose package is missing refused. Raises ValueError naming the option,
    the value and the choices (or the extra to install)."""
    from envs.grader import scorer_packages

    config = dataclasses.replace(config, **{name: with_members(getattr(config, name)) for name in sections()})
    if config.model.dtype == DType.FLOAT16:
        raise ValueError(f"ModelConfig.dtype='float16' (--dtype): {FLOAT16_TRAINING}")
    try:
        scorer_packages(config.rewards.grader)
    except ImportError as error:
        raise ValueError(f"RewardConfig.grader={config.rewards.grader.value!r} (--grader): {error}") from None
    return config


def validate(config: RunConfig) -> None:
    """Refuses ``config`` (given or resolved) if an option is out of its bounds or choices, names a missing
    file or package, or contradicts another option. Raises one ValueError of one line per problem, naming the
    option(s) and the fix: every option that is wrong alone; else the first problem of each check of options
    against each other (``CHECKS``)."""
    config = checked_modes(config)
    problems = [problem for option_problems in OPTION_PROBLEMS for problem in option_problems(config)]
    if not problems:
        problems = [problem for check in CHECKS if (problem := refusal(lambda: check(config))) is not None]
    if problems:
        raise ValueError("\n".join(problems))


def refusal(call: Callable[[], object]) -> str | None:
    """The message of the ValueError ``call()`` raises, or None when it raises none."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def bound_problems(config: RunConfig) -> Iterator[str]:
    """Each option within the bounds its field declares, and the positive, non-negative and unit-interval ones."""
    for name, (_, field) in OPTIONS.items():
        low, high, given_value = field.metadata["lower_bound"], field.metadata["upper_bound"], value(config, name)
        if given_value is not None and low is not None and given_value < low:
            yield f"--{name}={given_value}: must be >= {low}"
        if given_value is not None and high is not None and given_value > high:
            yield f"--{name}={given_value}: must be <= {high}"
    for names, within, bounds in ((POSITIVE, lambda x: x > 0, "> 0"), (NON_NEGATIVE, lambda x: x >= 0, ">= 0"),
                                  (PROBABILITIES, lambda x: 0 < x <= 1, "in (0, 1]"),
                                  (FRACTIONS, lambda x: 0 <= x <= 1, "in [0, 1]")):
        yield from (f"--{name}={value(config, name)}: must be {bounds}" for name in names
                    if not within(value(config, name)))


def name_problems(config: RunConfig) -> Iterator[str]:
    """--device and --experiment_name spelled as a device and a directory name."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", config.model.device) is None:
        yield f"--device={config.model.device}: must be auto, cpu, cuda, cuda:N or mps"
    name = config.logging.experiment_name
    if name is not None and re.fullmatch(r"[\w.\-]+", name) is None:
        yield f"--experiment_name={name!r}: must be letters, digits, '.', '-' or '_' (it names a directory)"


def path_problems(config: RunConfig) -> Iterator[str]:
    """Every path option names what it must (``check_path``), the held-out sets' paths too."""
    try:
        eval_paths = [eval_set.path for eval_set in parse_eval_sets(config.env.eval_dataset_path)]
    except ValueError as error:
        yield str(error)
        eval_paths = []
    paths = [(name, kind, value(config, name)) for name, kind in PATHS.items()]
    for name, kind, path_value in [*paths, *(("eval_dataset_path", "data", path) for path in eval_paths)]:
        problem = refusal(lambda: check_path(name, kind, path_value))
        if problem is not None:
            yield problem


def check_path(name: str, kind: str, path_value: str | None) -> None:
    """``path_value`` of --name is None or an existing ``kind``: "data" (a file or directory, or hf://NAME with
    the datasets package installed), "model" (a directory, or a hub id resolved later), "dir", or "checkpoint"
    (a checkpoint directory, or 'auto'). Raises ValueError."""
    if path_value is None or (kind == "checkpoint" and path_value == "auto"):
        return
    if kind == "data" and path_value.startswith("hf://"):
        if importlib.util.find_spec("datasets") is None:
            raise ValueError(f"--{name}={path_value!r} is a Hugging Face hub dataset, which needs the datasets "
                             "package: pip install datasets (or pass a local JSONL file)")
        return
    path = Path(path_value).expanduser()
    if kind == "model" and not path.exists() and looks_like_hub_id(path_value):
        return
    if not path.exists():
        raise ValueError(f"{path_value!r} does not exist; pass an existing path or leave --{name} out")
    if kind in ("dir", "model") and not path.is_dir():
        raise ValueError(f"{path_value!r} is not a directory; pass a Hugging Face model directory (--{name})")
    if kind == "checkpoint" and not (path / "manifest.json").is_file():
        raise ValueError(f"{path_value!r} has no manifest.json: pass 'auto' or a complete checkpoint directory "
                         "written by this trainer (<logdir>/<experiment>/<run>/checkpoints/iter_N) to --resume")


def looks_like_hub_id(path_value: str) -> bool:
    """Whether ``path_value`` has a hub id's shape, NAME or ORG/NAME (a missing relative path of at most two parts
    has it too; resolving it then says it is neither)."""
    return re.fullmatch(r"[\w\-.]+(/[\w\-.]+)?", path_value) is not None and not path_value.startswith((".", "-"))


def check_algorithm_options(config: RunConfig) -> None:
    """The options the chosen algorithm would ignore (``APPLIES_TO``) are not given; its groups (turn groups too)
    and its critic."""
    algorithm, critic = config.learning.algorithm, config.learning.critic
    for name, algorithms in APPLIES_TO.items():
        if algorithm not in algorithms and given(config, name):
            raise ValueError(f"--{name} applies to {'/'.join(algorithms)}; --algorithm_name={algorithm} would ignore "
                             f"it. Drop it or use --algorithm_name={algorithms[0]}")
    spec, threads = ALGORITHMS[algorithm], config.env.num_envs
    group_size = config.env.group_size or spec.default_group_size
    if threads % group_size:
        raise ValueError(f"--n_rollout_threads={threads} must be a multiple of --group_size={group_size}")
    if spec.grouped and group_size < 2:
        raise ValueError(f"--algorithm_name={algorithm} compares samples within a prompt group: "
                         f"--group_size={group_size} must be >= 2")
    if config.multi_agent.rollout_mode == RolloutMode.TREE and group_size < 2:
        raise ValueError(f"--rollout_mode tree continues a group's episodes from its best one; --group_size="
                         f"{group_size} makes groups of one: give --group_size >= 2")
    if spec.critic is not None and critic == Critic.OFF:
        raise ValueError(f"--algorithm_name={algorithm} needs a critic (its advantages come from V); drop "
                         f"--critic=off or use {'/'.join(algorithms_with(lambda spec: spec.critic is None))}")
    if spec.critic is None and critic not in (Critic.AUTO, Critic.OFF):
        raise ValueError(f"--algorithm_name={algorithm} is critic-free; drop --critic={critic} or use "
                         f"{'/'.join(algorithms_with(lambda spec: spec.critic is not None))}")
    if config.multi_agent.agent_groups == AgentGroups.AT_GRPO and not spec.turn_groups:
        raise ValueError(f"--agent_groups at_grpo compares one role's actions at one turn; --algorithm_name="
                         f"{algorithm} compares whole episodes: use "
                         f"{'/'.join(algorithms_with(lambda spec: spec.turn_groups))}, or --agent_groups role or joint")


def check_generation(config: RunConfig) -> None:
    """The backend's package and servers, asynchronous rollouts' backend, FSDP's full fine-tuning."""
    backend = config.generation.backend
    if backend == Backend.VLLM and importlib.util.find_spec("vllm") is None:
        raise ValueError("--generation_backend=vllm needs vLLM: pip install 'mathrl[vllm]' (or use "
                         "--generation_backend=hf)")
    if config.generation.async_rollouts and backend != Backend.HF:
        raise ValueError(f"--async_rollouts generates with an HF copy of the policy; with --generation_backend="
                         f"{backend} use --noasync_rollouts")
    if backend == Backend.VLLM_SERVER and config.services.vllm_url is None:
        raise ValueError("--generation_backend=vllm_server needs --vllm_url (the server of the policy)")
    extra = [name for name in VLLM_SERVER_OPTIONS if value(config, name) is not None]
    if backend != Backend.VLLM_SERVER and extra:
        raise ValueError(f"--{extra[0]} is for --generation_backend=vllm_server; add it or drop --{extra[0]}")
    if config.distributed.data_parallel == DataParallel.FSDP and config.model.lora_rank > 0:
        raise ValueError(f"--data_parallel=fsdp shards full fine-tuning; with --lora_rank={config.model.lora_rank} "
                         "the adapters are small enough for every rank: use --data_parallel ddp (or auto)")


def url_problems(config: RunConfig) -> Iterator[str]:
    """Each --*_url is one or more http(s)://HOST:PORT."""
    from models.remote import parse_urls

    for name in SERVICE_URLS:
        urls = value(config, name)
        if urls is not None and refusal(lambda: parse_urls(urls)) is not None:
            yield f"--{name}={urls!r}: must be http(s)://HOST:PORT[,http(s)://HOST:PORT...], e.g. http://127.0.0.1:8000"


def check_rewards(config: RunConfig) -> None:
    """--reward's sources and the models or servers behind them, one of the two for each; the PRM's adapter
    and key/value cache; 'steps' only where a canonical step-by-step solution exists."""
    rewards, services = config.rewards, config.services
    with_prm = rewards.prm_model is not None or services.prm_url is not None
    spec = rewards.spec or (DEFAULT_PRM_REWARD if with_prm else "outcome")
    names = reward_sources(spec)
    for source, where in (("prm", ("prm_model_name_or_path", "prm_url")),
                          ("target", ("target_model_name_or_path", "target_url"))):
        passed = [name for name in where if value(config, name) is not None]
        if source in names and not passed:
            raise ValueError(f"--reward uses {source!r} but neither --{where[0]} nor --{where[1]} is given")
        if len(passed) == 2:
            raise ValueError(f"--{where[0]} runs the {source} here and --{where[1]} on a server: give one")
        if passed and source not in names:
            raise ValueError(f"--{passed[0]} is given but --reward={spec!r} does not use {source!r}; add it (e.g. "
                             f"'{source}:0.2') or drop --{passed[0]}")
        if value(config, f"{source}_model_name") is not None and value(config, where[1]) is None:
            raise ValueError(f"--{source}_model_name names the model served at --{where[1]}; add --{where[1]} or "
                             "drop it")
    if rewards.prm_checkpoint_path is not None and rewards.prm_model is None:
        raise ValueError("--prm_checkpoint_path is an adapter for a local PRM: give --prm_model_name_or_path (a PRM "
                         "server applies its own adapter)")
    if rewards.prm_kv_cache_mb and rewards.prm_type != PrmType.SHEPHERD:
        raise ValueError(f"--prm_kv_cache_mb={rewards.prm_kv_cache_mb} needs --prm_type=shepherd; "
                         f"--prm_type={rewards.prm_type} always recomputes (drop the flag or pass 0)")
    on_math = config.env.dataset_path is not None or (config.env.env_id or "").rpartition(":")[2].startswith("MATH")
    if rewards.spec is not None and "steps" in reward_sources(rewards.spec) and on_math:
        raise ValueError("--reward uses 'steps', which pays the share of a canonical step-by-step solution reproduced "
                         "exactly: only Arith's generated problems have one (MATH solutions are prose, so it would "
                         "pay 0). Drop 'steps' or use an Arith env")


def check_env(config: RunConfig) -> None:
    """Where problems come from, how prompts are written, and Prefix-RL's hand-off."""
    env, handoff = config.env, config.prefix_rl.handoff_steps
    if (env.env_id or "").rpartition(":")[2].startswith("Arith") and env.dataset_path is not None:
        raise ValueError(f"--env_id={env.env_id} generates its problems; drop --dataset_path or use "
                         "--env_id=MATH-v0")
    if env.dataset_name is not None and env.dataset_path is None:
        raise ValueError("--dataset_name filters a MATH dataset's subjects: give --dataset_path too")
    if given(config, "answer_instruction") and env.answer_instruction and env.prompt_template != PromptTemplate.CHAT:
        raise ValueError("--answer_instruction ends the user turn of --prompt_template chat; add it, or write the "
                         "instruction into --system_prompt (qwen_math) instead")
    if env.system_prompt is not None and env.prompt_template == PromptTemplate.DEFAULT:
        raise ValueError("--system_prompt needs a chat prompt template: add --prompt_template chat (the tokenizer's "
                         "own) or qwen_math; the default plain template has no system turn")
    if handoff is None:
        return
    if config.rewards.spec is None or "target" not in reward_sources(config.rewards.spec):
        raise ValueError("--handoff_steps hands the prefix to the frozen target: add 'target' to --reward (e.g. "
                         "--reward target) and --target_model_name_or_path or --target_url")
    if env.action_level == ActionLevel.TOKEN:
        raise ValueError("--handoff_steps counts actions; with --action_level token use --action_level solution and "
                         "--max_new_tokens for a prefix of at most that many tokens")
    if env.action_level == ActionLevel.SOLUTION and handoff != 1:
        raise ValueError(f"--handoff_steps={handoff}: with --action_level solution an episode is one action; use "
                         "--handoff_steps 1, or --action_level step for a prefix of several steps")


def check_losses(config: RunConfig) -> None:
    """The clip ratios, the KL to the reference (in the loss or in the reward), the loss's aggregation."""
    learning = config.learning
    low, high, dual = learning.clip_ratio_low, learning.clip_ratio_high, learning.clip_ratio_c
    if low is not None and not 0 <= low < 1:
        raise ValueError(f"--clip_ratio_low={low} must be in [0, 1): the ratio's floor is 1 - clip_ratio_low")
    if high is not None and high < 0:
        raise ValueError(f"--clip_ratio_high={high} must be >= 0")
    if dual is not None and dual <= 1:
        raise ValueError(f"--clip_ratio_c={dual} must be > 1: it bounds the loss of a negative advantage at c |A|, "
                         "above the clipped ratio's (verl uses 3.0); leave it out for off")
    in_reward = kl_in_reward(learning.use_kl_in_reward, learning.algorithm)
    kl_options = [name for name in ("kl_loss_type", "use_kl_in_reward", "kl_penalty") if given(config, name)]
    if kl_options and learning.kl_coef == 0:
        raise ValueError(f"--{kl_options[0]} sets the KL to the reference, but --kl_coef is 0 (no KL); add "
                         "--kl_coef > 0 or drop it")
    if given(config, "kl_penalty") and not in_reward:
        raise ValueError("--kl_penalty is the estimator of the KL in the reward; add --use_kl_in_reward, or set the "
                         "loss's estimator with --kl_loss_type")
    if given(config, "kl_loss_type") and in_reward:
        raise ValueError(f"--kl_loss_type is the estimator of the KL in the loss, and the KL is in the reward "
                         f"(--use_kl_in_reward, default with {learning.algorithm}); use --kl_penalty, or "
                         "--nouse_kl_in_reward")
    if learning.loss_scale_factor is not None and learning.loss_agg_mode != LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
        raise ValueError(f"--loss_scale_factor divides seq-mean-token-sum-norm's token sums; with --loss_agg_mode="
                         f"{learning.loss_agg_mode} drop it (or use that mode, Dr. GRPO)")


def check_prime(config: RunConfig) -> None:
    """PRIME's accuracy band and min-form temperature."""
    low, high = config.prime.accuracy_lower_bound, config.prime.accuracy_upper_bound
    if not 0 <= low <= high <= 1:
        raise ValueError(f"need 0 <= --accuracy_lower_bound ({low}) <= --accuracy_upper_bound ({high}) <= 1")
    if given(config, "min_form_temperature") and config.prime.process_credit_assignment != ProcessCredit.MIN_FORM:
        raise ValueError("--min_form_temperature shapes --process_credit_assignment min_form; add it or drop the "
                         "temperature")
    if config.prime.min_form_temperature <= 0:
        raise ValueError(f"--min_form_temperature={config.prime.min_form_temperature} must be > 0 (PURE's: 0.1)")


def check_rollouts(config: RunConfig) -> None:
    """Dynamic sampling, the overlong penalty and masked cut-off answers, rollout correction: each option only
    with the one it shapes, and only where it means something."""
    rollout, algorithm = config.rollout, config.learning.algorithm
    spec = ALGORITHMS[algorithm]
    if given(config, "max_num_gen_batches") and not rollout.filter_groups:
        raise ValueError("--max_num_gen_batches bounds the rounds of --filter_groups; add --filter_groups or drop it")
    if rollout.filter_groups and not spec.episodic:
        raise ValueError(f"--filter_groups keeps prompt groups of varied returns; --algorithm_name={algorithm} "
                         f"collects no groups: use {'/'.join(algorithms_with(lambda spec: spec.episodic))}")
    if rollout.filter_groups and spec.prime and config.prime.oversample_factor > 1:
        raise ValueError(f"--filter_groups refills the batch with groups that have signal; {algorithm}'s "
                         f"--oversample_factor={config.prime.oversample_factor} selects them a second way: pass "
                         "--oversample_factor 1")
    for name in ("overlong_buffer_len", "overlong_penalty_factor"):
        if given(config, name) and not rollout.overlong_buffer:
            raise ValueError(f"--{name} shapes the penalty of --overlong_buffer; add --overlong_buffer or drop it")
    for name in ("overlong_buffer", "mask_truncated_completions", "filter_truncated"):
        if value(config, name) and config.env.action_level == ActionLevel.TOKEN:
            raise ValueError(f"--{name} concerns actions cut at --max_new_tokens; with --action_level token every "
                             "action is one token: use --action_level solution or step")
    max_new_tokens = config.generation.max_new_tokens
    if rollout.overlong_buffer and rollout.overlong_buffer_len > max_new_tokens:
        raise ValueError(f"--overlong_buffer_len={rollout.overlong_buffer_len} is longer than --max_new_tokens="
                         f"{max_new_tokens}; the buffer lies before the limit")
    check_rollout_correction(config)


def check_rollout_correction(config: RunConfig) -> None:
    """--rollout_is's options only with it; a band holding ratio 1; a mode the algorithm's loss can take."""
    rollout, algorithm = config.rollout, config.learning.algorithm
    for name in ("rollout_is_threshold", "rollout_is_threshold_lower", "rollout_is_level", "rollout_is_mode"):
        if given(config, name) and not rollout.rollout_is:
            raise ValueError(f"--{name} sets how --rollout_is corrects; add --rollout_is or drop it")
    upper, lower = rollout.rollout_is_threshold, rollout.rollout_is_threshold_lower
    if upper < 1:
        raise ValueError(f"--rollout_is_threshold={upper} < 1 would cut the weight of an on-policy token (ratio 1); "
                         "use a value >= 1 (TIS: 2)")
    if lower is not None and rollout.rollout_is_mode != RolloutIsMode.MASK:
        raise ValueError("--rollout_is_threshold_lower is the band's lower end of --rollout_is_mode mask; add it or "
                         "drop the flag")
    if lower is not None and not 0 < lower <= 1:
        raise ValueError(f"--rollout_is_threshold_lower={lower} must be in (0, 1] (the band holds ratio 1)")
    if rollout.rollout_is and rollout.rollout_is_mode == RolloutIsMode.TRUNCATE and (
            not ALGORITHMS[algorithm].token_loss):
        raise ValueError(f"--rollout_is_mode truncate weights each token's policy gradient; {algorithm}'s loss takes "
                         "one ratio per action: use --rollout_is_mode mask (or "
                         f"{'/'.join(algorithms_with(lambda spec: spec.token_loss))})")
    if rollout.rollout_is_mode == RolloutIsMode.MASK and rollout.rollout_is_level == RolloutIsLevel.TOKEN:
        raise ValueError("--rollout_is_mode mask drops whole actions: use --rollout_is_level sequence or geometric "
                         "(token-level ratios: --rollout_is_mode truncate)")


def check_evaluation(config: RunConfig) -> None:
    """Sampled evaluation's options only with --eval_samples."""
    for name in ("eval_temperature", "eval_top_p"):
        if given(config, name) and not config.budget.eval_samples:
            raise ValueError(f"--{name} sets how --eval_samples are drawn; add --eval_samples K (> 0) or drop it "
                             "(evaluation is otherwise greedy)")


def check_members(config: RunConfig) -> None:
    """Roles on base models of their own (--role_base_model): their --role_lr and --role_lora_rank name such roles;
    what a first version of them does not support is refused (a critic, PRIME's implicit PRM, asynchronous
    rollouts, a generation backend other than hf, FSDP)."""
    multi_agent = config.multi_agent
    members = multi_agent.base_models_by_role
    for flag, roles in (("role_lr", multi_agent.lrs_by_role), ("role_lora_rank", multi_agent.lora_ranks_by_role)):
        stray = sorted(set(roles) - set(members))
        if stray:
            raise ValueError(f"--{flag} {stray[0]}=...: role {stray[0]!r} has no --role_base_model (roles with one: "
                             f"{sorted(members) or 'none'}); add --role_base_model {stray[0]}=DIR or drop it")
    if not members:
        return
    spec, algorithm = ALGORITHMS[config.learning.algorithm], config.learning.algorithm
    role = next(iter(members))
    if spec.critic is not None:
        raise ValueError(f"--role_base_model {role}=... trains critic-free; --algorithm_name={algorithm} needs a "
                         f"critic: use {'/'.join(algorithms_with(lambda spec: spec.critic is None))}")
    if spec.prime and config.prime.process_coef > 0:
        raise ValueError(f"--role_base_model {role}=...: {algorithm}'s implicit PRM (--process_coef="
                         f"{config.prime.process_coef}) learns on the policy's base alone; pass --process_coef 0")
    if config.generation.async_rollouts:
        raise ValueError(f"--role_base_model {role}=... collects synchronously: drop --async_rollouts")
    if config.generation.backend != Backend.HF:
        raise ValueError(f"--role_base_model {role}=... generates with HF: use --generation_backend hf (not "
                         f"{config.generation.backend})")
    if config.distributed.data_parallel == DataParallel.FSDP:
        raise ValueError(f"--role_base_model {role}=...: every model of the team is replicated under DDP; use "
                         "--data_parallel ddp (or auto)")


OPTION_PROBLEMS = (bound_problems, name_problems, path_problems, url_problems)
"""The checks of each option alone: each yields every problem it finds."""
CHECKS = (check_algorithm_options, check_generation, check_rewards, check_env, check_losses, check_prime,
          check_rollouts, check_evaluation, check_members)
"""The checks of options against each other: each raises a ValueError at the first problem it finds."""
