"""A RunConfig resolved: the one place where the options left to other options (default None: the env id and
its workflow, the reward, episode length, group size, asynchronous rollouts, the experiment name, hub ids as
local snapshots) and the values derived from options (envs stepped per iteration, iterations, the prompt groups
an oversampling algorithm keeps) are worked out, after ``train.validation.validate``, and the checks that need
them (the env id's registration, its workflow and tool) run. A config from flags
(``train.flags.config_from_flags``) and one built in code go through the same ``resolved``.
"""

from __future__ import annotations

import dataclasses
import importlib

import gymnasium

import envs  # registers the built-in ids
from algorithms.config import kl_in_reward
from algorithms.registry import ALGORITHMS, collects_whole_episodes
from envs.modes import ActionLevel, Backend, Critic, DataParallel, LossAgg, Tool, member_of
from envs.workflows import Workflow, resolve_workflow
from models.hub import resolve_model
from models.remote import api_key_from
from train.config import DEFAULT_PRM_REWARD, DistributedConfig, EnvConfig, ModelConfig, RunConfig, ServicesConfig
from train.validation import checked_modes, given, reward_sources, validate

MULTI_AGENT_OPTIONS = ("reward_assignment", "role_model", "frozen_role", "role_base_model", "role_lr",
                       "role_lora_rank", "share_policy", "agent_groups", "rollout_mode")
"""Options that concern the roles of a multi-agent env (refused with a single-agent one)."""


def resolved(config: RunConfig) -> RunConfig:
    """``config`` validated (``train.validation.validate``), with every option left None worked out and every
    derived value set (idempotent). Raises ValueError naming the option (in its flag's spelling) and the fix."""
    validate(config)
    config = checked_modes(config)
    env_id = registered_env_id(config.env.env_id, config.env.dataset_path)
    workflow = with_frozen_roles(config.env.workflow or workflow_of(env_id), config.multi_agent.frozen_roles)
    spec = reward_spec(config, env_id)
    check_multi_agent(config, env_id, workflow, spec)
    env = resolved_env(config, env_id, workflow)
    learning, budget, generation = config.learning, config.budget, config.generation
    oversampled = config.prime.oversample_factor > 1
    prompt_groups = env.num_envs // env.group_size if oversampled else None
    iterations = budget.num_iterations or -(-budget.num_env_steps // (env.episode_length * env.envs_stepped))
    return dataclasses.replace(
        config, model=resolved_model(config, workflow), env=env,
        generation=dataclasses.replace(generation, async_rollouts=async_rollouts(config)),
        rewards=dataclasses.replace(config.rewards, spec=spec, prm_model=local_model(
            config, config.rewards.prm_model, "--prm_model_name_or_path")),
        learning=dataclasses.replace(learning, prompt_groups=prompt_groups, **resolved_losses(config)),
        multi_agent=dataclasses.replace(config.multi_agent, role_models=tuple(
            f"{role}={local_model(config, name, f'--role_model {role}')}"
            for role, name in config.multi_agent.models_by_role.items()), role_base_models=tuple(
            f"{role}={local_model(config, name, f'--role_base_model {role}')}"
            for role, name in config.multi_agent.base_models_by_role.items())),
        distributed=resolved_distributed(config),
        prefix_rl=dataclasses.replace(config.prefix_rl, target_model=local_model(
            config, config.prefix_rl.target_model, "--target_model_name_or_path")),
        budget=dataclasses.replace(budget, num_iterations=iterations),
        services=dataclasses.replace(config.services, api_key=api_key_from(config.services.api_key)),
        logging=dataclasses.replace(config.logging, experiment_name=experiment_name(config, env_id)))


def resolved_losses(config: RunConfig) -> dict:
    """The loss options left None: the KL in the reward (on for REINFORCE++), and seq-mean-token-sum-norm's fixed
    length (--max_new_tokens, the longest action)."""
    learning = config.learning
    scale_factor = learning.loss_scale_factor
    if learning.loss_agg_mode == LossAgg.SEQ_MEAN_TOKEN_SUM_NORM and scale_factor is None:
        scale_factor = config.generation.max_new_tokens
    return {"use_kl_in_reward": kl_in_reward(learning.use_kl_in_reward, learning.algorithm),
            "loss_scale_factor": scale_factor}


def registered_env_id(given: str | None, dataset_path: str | None) -> str:
    """The gymnasium id of --env_id (default: MATH-v0 with --dataset_path, else Arith-v0), after importing
    ``module`` of ``module:EnvId``; it must be registered with a vector entry point taking ``group_size``
    (MathVectorEnv or compatible)."""
    env_id = given if given is not None else ("MATH-v0" if dataset_path is not None else "Arith-v0")
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"--env_id={env_id}: cannot import registration module {module!r} ({error}); "
                             "it must be importable: add the directory holding it to PYTHONPATH (e.g. "
                             "PYTHONPATH=.)") from None
    if name not in gymnasium.registry:
        known = ", ".join(sorted(k for k in gymnasium.registry if k.startswith(("MATH", "Arith"))))
        raise ValueError(f"--env_id={env_id}: {name!r} is not a registered gymnasium id "
                         f"(built in: {known}); use 'module:EnvId' to import the module that registers it")
    if gymnasium.spec(name).vector_entry_point is None:
        raise ValueError(f"--env_id={env_id} has no vector_entry_point; the trainer needs a batched env "
                         "like envs.vector:MathVectorEnv (register one with vector_entry_point=...)")
    return name


def workflow_of(env_id: str) -> Workflow | None:
    """The Workflow of a multi-agent env (registered with ``workflow=``), else None."""
    workflow = gymnasium.spec(env_id).kwargs.get("workflow")
    return None if workflow is None else resolve_workflow(workflow)


def with_frozen_roles(workflow: Workflow | None, frozen: tuple[str, ...]) -> Workflow | None:
    """``workflow`` with the roles ``frozen`` (--frozen_role) marked trainable=False; at least one role must still
    train. Raises ValueError naming a role it does not have."""
    if workflow is None or not frozen:
        return workflow
    names = [role.name for role in workflow.roles]
    unknown = sorted(set(frozen) - set(names))
    if unknown:
        raise ValueError(f"--frozen_role {unknown[0]}: the workflow {workflow.name!r} has the roles {names}")
    roles = tuple(dataclasses.replace(role, trainable=False) if role.name in frozen else role
                  for role in workflow.roles)
    if not any(role.trainable for role in roles):
        raise ValueError(f"--frozen_role freezes every role of the workflow {workflow.name!r} ({names}): nothing "
                         "would train; leave at least one role out")
    return dataclasses.replace(workflow, roles=roles)


def reward_spec(config: RunConfig, env_id: str) -> str:
    """--reward, or its default: the outcome with a PRM's score when a PRM is given, else the env id's own
    declared default (``envs.default_reward``: Arith-v0's adds its exact step reward)."""
    if config.rewards.spec is not None:
        return config.rewards.spec
    if config.rewards.prm_model is not None or config.services.prm_url is not None:
        return DEFAULT_PRM_REWARD
    return envs.default_reward(env_id)


def check_multi_agent(config: RunConfig, env_id: str, workflow: Workflow | None, spec: str) -> None:
    """What a multi-agent env (every action a whole message, credit by --reward_assignment, the other --reward
    sources on answering roles' messages, no Prefix-RL hand-off) rules out, and the options (``MULTI_AGENT_OPTIONS``,
    the multi-agent critics) a single-agent env cannot use."""
    critic = config.learning.critic
    if workflow is None:
        for name in MULTI_AGENT_OPTIONS:
            if given(config, name):
                raise ValueError(f"--{name} concerns the roles of a multi-agent env; --env_id={env_id} has one agent "
                                 "(use e.g. --env_id Arith-Chain-v0, or drop it)")
        if critic in (Critic.CENTRALIZED, Critic.PER_ROLE):
            raise ValueError(f"--critic={critic} concerns the roles of a multi-agent env; "
                             f"--env_id={env_id} has one agent (use --critic on, or e.g. --env_id "
                             "Arith-Chain-v0)")
        return
    if config.prefix_rl.handoff_steps is not None:
        raise ValueError(f"--handoff_steps with the multi-agent --env_id={env_id}: Prefix-RL is Arith-Prefix-v0 there "
                         "(its solver role finishes the writer's prefix)")
    if not config.multi_agent.share_policy and config.model.lora_rank == 0:
        raise ValueError("--noshare_policy gives each role a LoRA adapter on the shared base: add "
                         "--lora_rank > 0 (now 0)")
    frozen = [role.name for role in workflow.roles if not role.trainable]
    for role in config.multi_agent.models_by_role:
        if role not in frozen:
            raise ValueError(f"--role_model {role}=...: the frozen roles of --env_id={env_id} are "
                             f"{frozen or 'none'}; a trained role speaks with the policy (or with "
                             f"--role_base_model {role}=DIR learns on a model of its own)")
    trained = [role.name for role in workflow.roles if role.trainable]
    for role in config.multi_agent.base_models_by_role:
        if role not in trained:
            raise ValueError(f"--role_base_model {role}=...: the trained roles of --env_id={env_id} are "
                             f"{trained}; a frozen role speaks with --role_model {role}=DIR")
    if config.env.action_level != ActionLevel.SOLUTION:
        raise ValueError(f"--action_level={config.env.action_level}: in the multi-agent --env_id={env_id} "
                         "every action is one role's whole message; use --action_level solution")
    check_workflow_reward(spec, env_id, workflow)


def check_workflow_reward(spec: str, env_id: str, workflow: Workflow) -> None:
    """A workflow's --reward must hold 'outcome' (the --reward_assignment credit) and no second target."""
    sources = reward_sources(spec)
    if "outcome" not in sources:
        raise ValueError(f"--reward={spec!r} with the multi-agent --env_id={env_id}: its 'outcome' source "
                         "is the --reward_assignment credit, which every role needs; add it, e.g. "
                         "--reward outcome:1.0,prm:0.2")
    if "target" in sources and any(role.continues for role in workflow.roles):
        continuing = next(role.name for role in workflow.roles if role.continues)
        raise ValueError(f"--reward uses 'target' with --env_id={env_id}, whose {continuing} role already "
                         "is the frozen target finishing the prefix; drop 'target' from --reward and give "
                         f"the target as --role_model {continuing}=DIR")


def local_model(config: RunConfig, value: str | None, flag: str) -> str | None:
    """A model flag's local directory: the directory itself, or a hub id's snapshot at --revision."""
    return None if value is None else str(resolve_model(value, config.model.revision, flag))


def resolved_model(config: RunConfig, workflow: Workflow | None) -> ModelConfig:
    """The policy's local directory, its roles' adapters and its value heads."""
    model, shared, members = config.model, config.multi_agent.share_policy, config.multi_agent.base_models_by_role
    trained = () if shared or workflow is None else tuple(role.name for role in workflow.roles
                                                          if role.trainable and role.name not in members)
    per_role_critic = workflow is not None and config.learning.critic == Critic.PER_ROLE
    return dataclasses.replace(model, name_or_path=local_model(config, model.name_or_path, "--model_name_or_path"),
                               role_adapters=trained, value_heads=len(workflow.roles) if per_role_critic else 1)


def resolved_env(config: RunConfig, env_id: str, workflow: Workflow | None) -> EnvConfig:
    """The env section with its id registered, its workflow, episode length, group size, envs stepped per
    iteration (times the oversampling of an algorithm with PRIME) and whether iterations collect whole episodes."""
    env, spec = config.env, ALGORITHMS[config.learning.algorithm]
    resolved_env = dataclasses.replace(
        env, env_id=env_id, workflow=workflow, episode_length=episode_length(config, env_id, workflow),
        group_size=env.group_size or spec.default_group_size,
        envs_stepped=env.num_envs * (config.prime.oversample_factor if spec.prime else 1),
        whole_episodes=collects_whole_episodes(spec, workflow is not None))
    check_env_kwargs(resolved_env)
    return dataclasses.replace(resolved_env, tools=resolved_tool(resolved_env, config.services))


def resolved_tool(env: EnvConfig, services: ServicesConfig) -> Tool:
    """--tools, or the env's own (its --env_kwargs' or its registered 'tools'; none without). A tool needs
    --action_level step and a single-agent env; the tool's other options, and --tool_url, need a tool."""
    own = {**gymnasium.spec(env.env_id).kwargs, **env.user_kwargs}.get("tools")
    tool = member_of(tuple(Tool), env.tools or own or Tool.NONE, "tools", " (--tools, or the env's 'tools' keyword)")
    if tool == Tool.NONE:
        tool_options = {"max_tool_calls": env.max_tool_calls, "max_tool_response_length": env.max_tool_output_chars,
                 "tool_timeout": env.tool_timeout, "tool_url": services.tool_url}
        for name, value in tool_options.items():
            if value is not None:
                raise ValueError(f"--{name} sets the policy's tool, and --env_id={env.env_id} runs none "
                                 f"(--tools={env.tools}): add --tools python or drop --{name}")
        return tool
    if env.workflow is not None:
        raise ValueError(f"--tools={tool}: the multi-agent --env_id={env.env_id} does not run its roles' "
                         "code; use a single-agent id (MATH-Tool-v0, Arith-Tool-v0) or --tools none")
    if env.action_level != ActionLevel.STEP:
        raise ValueError(f"--env_id={env.env_id} runs a {tool} tool between reasoning steps: add "
                         f"--action_level step (not {env.action_level}), or --tools none")
    return tool


def check_env_kwargs(env: EnvConfig) -> None:
    """--env_kwargs parsed and checked against the env id (``envs.override_kwargs``), before torch loads."""
    try:
        env.user_kwargs  # noqa: B018  (the property parses and checks)
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"--env_kwargs={env.env_kwargs!r}: {error}") from None


def episode_length(config: RunConfig, env_id: str, workflow: Workflow | None) -> int:
    """--episode_length, or its default: a workflow's most turns (or its env's max_steps); else 1 with
    --action_level solution and 8 otherwise."""
    if config.env.episode_length is not None:
        return config.env.episode_length
    if workflow is not None:
        return workflow.max_turns or gymnasium.spec(env_id).kwargs.get("max_steps", 8)
    return 1 if config.env.action_level == ActionLevel.SOLUTION else 8


def async_rollouts(config: RunConfig) -> bool:
    """--async_rollouts, or its default (``default_async_rollouts``); --max_policy_lag, which bounds them, only
    with them on."""
    given_value = config.generation.async_rollouts
    on = default_async_rollouts(config) if given_value is None else given_value
    if given(config, "max_policy_lag") and not on:
        raise ValueError("--max_policy_lag bounds asynchronous rollouts; add --async_rollouts or drop it")
    return on


def default_async_rollouts(config: RunConfig) -> bool:
    """On with the HF backend for an algorithm asynchronous by design (its spec's ``asynchronous``), and for every
    algorithm on a CPU (where the second thread has a core of its own; on one GPU the copy's memory would buy
    little overlap); off with roles on base models of their own (--role_base_model), which collect
    synchronously."""
    if config.generation.backend != Backend.HF or config.multi_agent.role_base_models:
        return False
    if ALGORITHMS[config.learning.algorithm].asynchronous:
        return True
    device = config.model.device
    if device == "auto":
        import torch  # here: parsing flags stays light until a run is configured

        return not torch.cuda.is_available()
    return device == "cpu"


def resolved_distributed(config: RunConfig) -> DistributedConfig:
    """--data_parallel auto with roles on base models of their own is ddp: the team is replicated whole."""
    distributed = config.distributed
    if config.multi_agent.role_base_models and distributed.data_parallel == DataParallel.AUTO:
        return dataclasses.replace(distributed, data_parallel=DataParallel.DDP)
    return distributed


def experiment_name(config: RunConfig, env_id: str) -> str:
    """--experiment_name, or <algorithm>_<env>."""
    if config.logging.experiment_name is not None:
        return config.logging.experiment_name
    return f"{config.learning.algorithm}_{env_id}"
