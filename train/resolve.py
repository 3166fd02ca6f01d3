"""Flags resolved into a ``train.config.RunConfig``: the one place where values that depend on other flags
are worked out (the env id and its workflow, the reward, episode length, group size, asynchronous rollouts,
the experiment name, hub ids as local snapshots) and the checks that need them run.
"""

from __future__ import annotations

import importlib
import json

import gymnasium
from absl import flags

import envs  # registers the built-in ids
from algorithms.registry import ALGORITHMS, AlgorithmConfig, LossAgg, ScaleRewards
from envs.workflows import Workflow, resolve_workflow
from models.hub import resolve_model
from train.config import (DEFAULT_PRM_REWARD, PRM_TYPES, ActionLevel, BudgetConfig, EnvConfig, EvalSet,
                          GenerationConfig, LearningConfig, LoggingConfig, LrSchedule, ModelConfig, RewardAssignment,
                          RewardConfig, RunConfig, ServicesConfig)
from train.flags.checks import check_algorithm_specific, default_group_size, eval_sets, reward_sources
from train.options import section_from_flags


def config_from_flags(f: flags.FlagValues) -> RunConfig:
    """Every flag resolved once into a RunConfig. Raises flags.Error or ValueError naming the flag and the fix."""
    from train.flags import flag_dict

    check_algorithm_specific(f)
    env_id = registered_env_id(f)
    workflow = workflow_of(env_id)
    check_multi_agent(f, workflow)
    env = env_config(f, env_id, workflow)
    generation = generation_config(f)
    return RunConfig(model=model_config(f, workflow), env=env, rewards=reward_config(f),
                     learning=learning_config(f, workflow), generation=generation,
                     budget=BudgetConfig(num_iterations=-(-f.num_env_steps // (env.episode_length * env.num_envs)),
                                         num_env_steps=f.num_env_steps, eval_interval=f.eval_interval,
                                         eval_limit=f.eval_limit, **eval_sampling(f)),
                     services=services_config(f), logging=logging_config(f), seed=f.seed,
                     flags=flag_dict(f))


def env_id_given(f: flags.FlagValues) -> str:
    """--env_id, or its default: MATH-v0 with --dataset_path, else Arith-v0."""
    if f.env_id is not None:
        return f.env_id
    return "MATH-v0" if f.dataset_path is not None else "Arith-v0"


def registered_env_id(f: flags.FlagValues) -> str:
    """The gymnasium id of --env_id, after importing ``module`` of ``module:EnvId``; it must be registered
    with a vector entry point taking ``group_size`` (MathVectorEnv or compatible)."""
    env_id = env_id_given(f)
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise flags.ValidationError(f"--env_id={env_id}: cannot import registration module {module!r} ({error}); "
                                        "it must be importable: add the directory holding it to PYTHONPATH (e.g. "
                                        "PYTHONPATH=.)") from None
    if name not in gymnasium.registry:
        known = ", ".join(sorted(k for k in gymnasium.registry if k.startswith(("MATH", "Arith"))))
        raise flags.ValidationError(f"--env_id={env_id}: {name!r} is not a registered gymnasium id (built in: {known}); "
                                    "use 'module:EnvId' to import the module that registers it")
    if gymnasium.spec(name).vector_entry_point is None:
        raise flags.ValidationError(f"--env_id={env_id} has no vector_entry_point; the trainer needs a batched env "
                                    "like envs.vector:MathVectorEnv (register one with vector_entry_point=...)")
    return name


def workflow_of(env_id: str) -> Workflow | None:
    """The Workflow of a multi-agent env (registered with ``workflow=``), else None."""
    workflow = gymnasium.spec(env_id).kwargs.get("workflow")
    return None if workflow is None else resolve_workflow(workflow)


def reward_spec(f: flags.FlagValues) -> str:
    """--reward, or its default: the outcome with a PRM's score when a PRM is given, else the env id's own
    declared default (``envs.default_reward``: Arith-v0's adds its exact step reward)."""
    if f.reward is not None:
        return f.reward
    if f.prm_model_name_or_path is not None or f.prm_url is not None:
        return DEFAULT_PRM_REWARD
    return envs.default_reward(registered_env_id(f))


def check_multi_agent(f: flags.FlagValues, workflow: Workflow | None) -> None:
    """What a multi-agent env (every action a whole message, credit by --reward_assignment, the other --reward
    sources on answering roles' messages) rules out, and the role flags a single-agent env cannot use."""
    env_id = env_id_given(f)
    if workflow is None:
        for name in ("reward_assignment", "role_model", "share_policy", "agent_groups"):
            if f[name].present:
                raise flags.ValidationError(f"--{name} concerns the roles of a multi-agent env; --env_id={env_id} "
                                            "has one agent (use e.g. --env_id Arith-Chain-v0, or drop it)")
        if f.critic in ("centralized", "per_role"):
            raise flags.ValidationError(f"--critic={f.critic} concerns the roles of a multi-agent env; "
                                        f"--env_id={env_id} has one agent (use --critic on, or e.g. --env_id "
                                        "Arith-Chain-v0)")
        return
    if not f.share_policy and f.lora_rank == 0:
        raise flags.ValidationError("--noshare_policy gives each role a LoRA adapter on the shared base: add "
                                    "--lora_rank > 0 (now 0)")
    frozen = [role.name for role in workflow.roles if not role.trainable]
    for role in role_models(f):
        if role not in frozen:
            raise flags.ValidationError(f"--role_model {role}=...: the frozen roles of --env_id={env_id} are "
                                        f"{frozen or 'none'}; a trained role speaks with the policy")
    if f.action_level != "solution":
        raise flags.ValidationError(f"--action_level={f.action_level}: in the multi-agent --env_id={env_id} every "
                                    "action is one role's whole message; use --action_level solution")
    if f["handoff_steps"].present:
        raise flags.ValidationError(f"--handoff_steps with the multi-agent --env_id={env_id}: Prefix-RL is "
                                    "Arith-Prefix-v0 there (its solver role finishes the writer's prefix)")
    check_workflow_reward(reward_spec(f), env_id, workflow)


def check_workflow_reward(spec: str, env_id: str, workflow: Workflow) -> None:
    """A workflow's --reward must hold 'outcome' (the --reward_assignment credit) and no second target."""
    sources = reward_sources(spec)
    if "outcome" not in sources:
        raise flags.ValidationError(f"--reward={spec!r} with the multi-agent --env_id={env_id}: its 'outcome' source "
                                    "is the --reward_assignment credit, which every role needs; add it, e.g. "
                                    "--reward outcome:1.0,prm:0.2")
    if "target" in sources and any(role.continues for role in workflow.roles):
        continuing = next(role.name for role in workflow.roles if role.continues)
        raise flags.ValidationError(f"--reward uses 'target' with --env_id={env_id}, whose {continuing} role already "
                                    "is the frozen target finishing the prefix; drop 'target' from --reward and give "
                                    f"the target as --role_model {continuing}=DIR")


def role_models(f: flags.FlagValues) -> dict[str, str]:
    """--role_model entries as {role: model directory or hub id}."""
    models = {}
    for entry in f.role_model:
        role, sep, directory = entry.partition("=")
        if not sep or not role or not directory:
            raise flags.ValidationError(f"--role_model={entry!r} must be ROLE=DIR (e.g. solver=/models/target)")
        models[role] = directory
    return models


def local_model(f: flags.FlagValues, value: str | None, flag: str) -> str | None:
    """A model flag's local directory: the directory itself, or a hub id's snapshot at --revision."""
    return None if value is None else str(resolve_model(value, f.revision, flag))


def model_config(f: flags.FlagValues, workflow: Workflow | None) -> ModelConfig:
    trained = [] if f.share_policy or workflow is None else [role.name for role in workflow.roles if role.trainable]
    per_role_critic = workflow is not None and f.critic == "per_role"
    frozen = {role: local_model(f, name, f"--role_model {role}") for role, name in role_models(f).items()}
    return ModelConfig(name_or_path=local_model(f, f.model_name_or_path, "--model_name_or_path"), revision=f.revision,
                       device=f.device, dtype=f.dtype, lora_rank=f.lora_rank,
                       gradient_checkpointing=f.gradient_checkpointing, role_adapters=tuple(trained),
                       role_models=frozen, value_heads=len(workflow.roles) if per_role_critic else 1,
                       torch_threads=f.torch_threads, return_freed_memory=f.return_freed_memory,
                       data_parallel=f.data_parallel, dist_timeout=f.dist_timeout)


def env_config(f: flags.FlagValues, env_id: str, workflow: Workflow | None) -> EnvConfig:
    oversample = f.oversample_factor if f.algorithm_name == "RLOO" else 1
    return EnvConfig(env_id=env_id, workflow=workflow, dataset_path=f.dataset_path, dataset_name=f.dataset_name,
                     eval_sets=tuple(EvalSet(name, path) for name, path in eval_sets(f.eval_dataset_path)),
                     action_level=ActionLevel(f.action_level),
                     handoff_steps=f.handoff_steps,
                     episode_length=episode_length(f, env_id, workflow), num_envs=f.n_rollout_threads * oversample,
                     group_size=f.group_size or default_group_size(f.algorithm_name),
                     whole_episodes=ALGORITHMS[f.algorithm_name].episodic or workflow is not None,
                     eval_batch_size=f.eval_batch_size, reward_assignment=RewardAssignment(f.reward_assignment),
                     prompt_template=f.prompt_template, system_prompt=f.system_prompt,
                     answer_instruction=f.answer_instruction, env_kwargs=user_env_kwargs(f, env_id),
                     tools=tool_of(f, env_id, workflow), max_tool_calls=f.max_tool_calls,
                     max_tool_output_chars=f.max_tool_response_length, tool_timeout=f.tool_timeout)


def tool_of(f: flags.FlagValues, env_id: str, workflow: Workflow | None) -> str | None:
    """The policy's tool: --tools ('none': off), else --env_kwargs' or the env id's own; it needs --action_level
    step and a single-agent env. The tool's other flags, and --tool_url, need a tool."""
    own = {**gymnasium.spec(env_id).kwargs, **(json.loads(f.env_kwargs) if f.env_kwargs else {})}.get("tools")
    tool = own if f.tools is None else None if f.tools == "none" else f.tools
    if tool is None:
        for name in ("max_tool_calls", "max_tool_response_length", "tool_timeout", "tool_url"):
            if f[name].value is not None:
                raise flags.ValidationError(f"--{name} sets the policy's tool, and --env_id={env_id} runs none "
                                            f"(--tools={f.tools}): add --tools python or drop --{name}")
        return None
    if workflow is not None:
        raise flags.ValidationError(f"--tools={tool}: the multi-agent --env_id={env_id} does not run its roles' code; "
                                    "use a single-agent id (MATH-Tool-v0, Arith-Tool-v0) or --tools none")
    if f.action_level != "step":
        raise flags.ValidationError(f"--env_id={env_id} runs a {tool} tool between reasoning steps: add "
                                    f"--action_level step (not {f.action_level}), or --tools none")
    return tool


def user_env_kwargs(f: flags.FlagValues, env_id: str) -> dict:
    """--env_kwargs parsed and checked against ``env_id`` (``envs.override_kwargs``), before torch loads."""
    if f.env_kwargs is None:
        return {}
    try:
        return envs.override_kwargs(env_id, json.loads(f.env_kwargs))
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        raise flags.ValidationError(f"--env_kwargs={f.env_kwargs!r}: {error}") from None


def eval_sampling(f: flags.FlagValues) -> dict:
    """--eval_samples and how they are drawn; --eval_temperature and --eval_top_p need --eval_samples."""
    for name in ("eval_temperature", "eval_top_p"):
        if f[name].present and not f.eval_samples:
            raise flags.ValidationError(f"--{name} sets how --eval_samples are drawn; add --eval_samples K (> 0) or "
                                        "drop it (evaluation is otherwise greedy)")
    return {"eval_samples": f.eval_samples, "eval_temperature": f.eval_temperature, "eval_top_p": f.eval_top_p}


def episode_length(f: flags.FlagValues, env_id: str, workflow: Workflow | None) -> int:
    """--episode_length, or its default: a workflow's most turns (or its env's max_steps); else 1 with
    --action_level solution and 8 otherwise."""
    if f.episode_length is not None:
        return f.episode_length
    if workflow is not None:
        return workflow.max_turns or gymnasium.spec(env_id).kwargs.get("max_steps", 8)
    return 1 if f.action_level == "solution" else 8


def reward_config(f: flags.FlagValues) -> RewardConfig:
    return RewardConfig(spec=reward_spec(f), prm_model=local_model(f, f.prm_model_name_or_path,
                                                                   "--prm_model_name_or_path"),
                        prm_checkpoint_path=f.prm_checkpoint_path, prm_type=PRM_TYPES[f.prm_type.lower()],
                        prm_step_tag=f.prm_step_tag, prm_kv_cache_mb=f.prm_kv_cache_mb,
                        target_model=local_model(f, f.target_model_name_or_path, "--target_model_name_or_path"),
                        target_num_samples=f.target_num_samples,
                        target_temperature=f.target_temperature, target_max_new_tokens=f.target_max_new_tokens)


def learning_config(f: flags.FlagValues, workflow: Workflow | None) -> LearningConfig:
    losses = AlgorithmConfig(
        clip_param=f.clip_param, value_clip_param=f.value_clip_param or None, huber_delta=f.huber_delta or None,
        value_coef=f.value_coef, entropy_coef=f.entropy_coef, gamma=f.gamma, gae_lambda=f.gae_lambda,
        value_lambda=f.value_lambda, scale_rewards=ScaleRewards(f.scale_rewards), kl_coef=f.kl_coef,
        loss_agg=LossAgg(f.loss_agg),
        process_coef=f.process_coef, accuracy_lower_bound=f.accuracy_lower_bound,
        accuracy_upper_bound=f.accuracy_upper_bound, joint_groups=f.agent_groups == "joint")
    group_size = f.group_size or default_group_size(f.algorithm_name)
    return LearningConfig(
        algorithm=f.algorithm_name, losses=losses,
        prompt_groups=f.n_rollout_threads // group_size if f.oversample_factor > 1 else None,
        critic_view="per_role" if f.critic == "per_role" else "centralized", lr=f.lr, critic_lr=f.critic_lr,
        warmup_iterations=f.warmup_iterations, lr_schedule=LrSchedule(f.lr_schedule), num_mini_batch=f.num_mini_batch,
        ppo_epoch=f.ppo_epoch, gradient_cp_steps=f.gradient_cp_steps, micro_batch_tokens=f.micro_batch_tokens,
        max_grad_norm=f.max_grad_norm,
        target_kl=f.target_kl, max_nonfinite_steps=f.max_nonfinite_steps, implicit_prm_beta=f.implicit_prm_beta,
        implicit_prm_lr=f.implicit_prm_lr)


def generation_config(f: flags.FlagValues) -> GenerationConfig:
    asynchronous = async_rollouts(f)
    if f["max_policy_lag"].present and not asynchronous:
        raise flags.ValidationError("--max_policy_lag bounds asynchronous rollouts; add --async_rollouts or drop it")
    return section_from_flags(GenerationConfig, f, async_rollouts=asynchronous)


def async_rollouts(f: flags.FlagValues) -> bool:
    """--async_rollouts, or its default: on with the HF backend for APPO, and for every algorithm on a CPU
    (where the second thread has a core of its own; on one GPU the copy's memory would buy little overlap)."""
    if f.async_rollouts is not None:
        return f.async_rollouts
    if f.generation_backend != "hf":
        return False
    if f.algorithm_name == "APPO":
        return True
    if f.device == "auto":
        import torch  # here: parsing flags stays light until a run is configured

        return not torch.cuda.is_available()
    return f.device == "cpu"


def services_config(f: flags.FlagValues) -> ServicesConfig:
    """The services' options, the key from --service_api_key or $MATHRL_SERVICE_API_KEY."""
    from models.remote import api_key_from  # stdlib only

    return section_from_flags(ServicesConfig, f, api_key=api_key_from(f.service_api_key))


def logging_config(f: flags.FlagValues) -> LoggingConfig:
    return section_from_flags(LoggingConfig, f, experiment_name=experiment_name(f))


def experiment_name(f: flags.FlagValues) -> str:
    """--experiment_name, or <algorithm>_<env>."""
    if f.experiment_name is not None:
        return f.experiment_name
    return f"{f.algorithm_name}_{env_id_given(f).rpartition(':')[2]}"
