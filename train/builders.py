"""Builders: a RunConfig's parts in, the pieces of a training run out, and ``build_runner`` composing them.

Each builder takes only the part of ``train.config.RunConfig`` it needs, so train_math.py, the
benchmarks, the tests and library users build a run the same way, with or without absl flags.
``build_envs`` is where a process's share of the environments is decided.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import gymnasium
import torch
from gymnasium.vector import AutoresetMode

import envs  # noqa: F401  (registers the built-in ids)
from algorithms.base import Algorithm, make_algorithm
from algorithms.config import AlgorithmConfig, LossOptions, MultiAgentOptions, PrimeOptions
from algorithms.registry import algorithm_spec
from envs.datasets import load_problems
from envs.math_env import MAX_TOOL_OUTPUT_CHARS, TOOL_TIMEOUT_S
from envs.modes import ActionLevel, Backend, DataParallel, DType, LrSchedule, PrmType, RolloutMode, Tool
from envs.prompts import STEP_DELIMITER
from envs.rewards import OutcomeReward, OverlongPenalty, RewardMixture, RewardModel
from reward_models.implicit_prm import ImplicitPRM
from train import checkpoint_files, distributed
from train.collector import Collector
from train.config import (EnvConfig, GenerationConfig, LearningConfig, ModelConfig, RewardConfig, RolloutConfig,
                          RunConfig, ServicesConfig)
from train.distributed import Ranks
from train.episodes import RoleModels, Sampling
from train.members import Member, memory_line
from models.generation import Generator, make_generator
from models.loading import check_model_dir, resolve_device
from models.policy import LanguagePolicy, LoraSettings
from models.prompting import build_template, tool_turn_template
from models.team import Team
from models.remote import ServiceClient, ServiceError
from train.resolve import resolved
from train.runner import Runner

log = logging.getLogger(__name__)

GeneratorFactory = Callable[[LanguagePolicy], Generator]


def model_dir(model: ModelConfig, multi_agent: bool) -> str:
    """The policy's directory, or the tiny policy the package ships: on a multi-agent env the tiny team model,
    which has learned the built-in workflows' roles."""
    if model.name_or_path is not None:
        return model.name_or_path
    from models.tiny import shipped_models  # the tiny package loads only when it is needed

    kind = "team" if multi_agent else "policy"
    directory = str(getattr(shipped_models(team=multi_agent), kind))
    log.info("no --model_name_or_path: using the shipped tiny %s, %s", kind, directory)
    return directory


def check_inputs(config: RunConfig) -> None:
    """What can be checked before any model loads: the device exists, every model directory holds a config,
    weights and a tokenizer, the servers answer, and the datasets read and select at least one problem.
    Raises ValueError naming the flag (and file and line) and the fix."""
    resolve_device(config.model.device)
    role_models = config.multi_agent.models_by_role
    for flag, directory in (("--model_name_or_path", config.model.name_or_path),
                            ("--target_model_name_or_path", config.prefix_rl.target_model),
                            *((f"--role_model {role}", path) for role, path in role_models.items()),
                            *((f"--role_base_model {role}", path)
                              for role, path in config.multi_agent.base_models_by_role.items())):
        if directory is not None:
            check_model_dir(directory, flag)
    if config.rewards.prm_model is not None:
        from reward_models.prm import check_prm_dir

        check_prm_dir(config.rewards.prm_model, config.rewards.prm_type, role="--prm_model_name_or_path",
                      **prm_marker(config.rewards))
    check_services(config.services)
    env = config.env
    for flag, path, subjects in (("--dataset_path", env.dataset_path, env.dataset_name),
                                 *(("--eval_dataset_path", eval_set.path, None) for eval_set in env.eval_sets)):
        if path is not None and not path.startswith("hf://"):  # hub datasets load once, later
            try:
                load_problems(path, subjects=[subjects] if subjects is not None else None)
            except ValueError as error:
                raise ValueError(f"{flag}: {error}") from error


def check_services(services: ServicesConfig) -> None:
    """Every given server answers and serves the named model (or exactly one)."""
    for service in ("target", "prm", "vllm"):
        url, name = getattr(services, f"{service}_url"), getattr(services, f"{service}_model_name")
        if url is not None:
            try:
                ServiceClient(url, services.client).check(name)
            except ServiceError as error:
                raise ServiceError(f"--{service}_url: {error}") from error


def lora_settings(rank: int) -> LoraSettings | None:
    """LoRA of ``rank`` (alpha twice the rank), or None (full fine-tuning) for rank 0."""
    return LoraSettings(rank=rank, alpha=2.0 * rank) if rank else None


def language_policy(directory: str, model: ModelConfig, device: str | torch.device, *, lora_rank: int = 0,
                    trained: bool = False, **settings: Any) -> LanguagePolicy:
    """The one way a run builds a LanguagePolicy (its policy, a member, the rollout copy, a frozen role, the
    target, PRIME's implicit PRM): the model in ``directory`` on ``device`` in the run's --dtype, in eval mode (no
    dropout: recomputed log-probs must match the sampler's). ``lora_rank``: its LoRA (0: none); ``trained``: it
    learns through the policy's update, so --gradient_checkpointing applies; ``settings``: LanguagePolicy's other
    keywords (critic, role adapters...)."""
    checkpointing = {"gradient_checkpointing": model.gradient_checkpointing} if trained else {}
    return LanguagePolicy(directory, device=device, dtype=model.dtype, lora=lora_settings(lora_rank),
                          **checkpointing, **settings).eval()


def shards_weights(data_parallel: DataParallel, lora_rank: int, ranks: Ranks) -> bool:
    """Whether the policy is sharded with FSDP2 (``data_parallel`` fsdp, or auto with full fine-tuning)."""
    return ranks.distributed and (data_parallel == DataParallel.FSDP
                                  or (data_parallel == DataParallel.AUTO and not lora_rank))


def build_policy(model: ModelConfig, directory: str, algorithm: str, ranks: Ranks = Ranks(),
                 data_parallel: DataParallel = DataParallel.AUTO) -> LanguagePolicy:
    """The trained policy (with a critic for APPO/TPPO) at its starting weights (a resumed run loads its
    checkpoint's into it: ``Runner.restore``); in eval mode (no dropout: recomputed log-probs must match
    the sampler's). Sharded with FSDP2, only rank 0 reads the weights (the others receive their shards)."""
    with_critic = algorithm_spec(algorithm).critic is not None
    return language_policy(directory, model, str(resolve_device(model.device)), lora_rank=model.lora_rank,
                           trained=True, with_critic=with_critic, role_adapters=model.role_adapters,
                           value_heads=model.value_heads,
                           weights_from_rank0=shards_weights(data_parallel, model.lora_rank, ranks))


def build_reward_model(config: RunConfig, device: str, policy_template: str) -> RewardModel:
    """The env's reward model from the reward spec: one source, or a weighted RewardMixture (on a multi-agent
    env its 'outcome' source is the reward-assignment credit). ``policy_template``: the policy's prompt
    template (a served target reads it too)."""
    weights = config.rewards.weights
    models = {name: build_reward_source(config, name, device, policy_template) for name in weights}
    if len(weights) == 1 and next(iter(weights.values())) == 1.0:
        return next(iter(models.values()))
    return RewardMixture(models, weights)


def build_reward_source(config: RunConfig, name: str, device: str, policy_template: str) -> RewardModel:
    """One reward source; the model-based ones load only when asked for."""
    rewards, services = config.rewards, config.services
    if name == "outcome":
        return OutcomeReward(grader=rewards.grader)
    if name == "steps":
        from reward_models.reference_steps import ReferenceStepsReward

        return ReferenceStepsReward()
    if name == "prm" and services.prm_url is not None:
        from reward_models.remote import RemotePRM

        return RemotePRM(services.prm_url, services.prm_model_name, settings=services.client)
    if name == "prm":
        from reward_models.prm import ProcessRewardModel

        return ProcessRewardModel(rewards.prm_model, prm_type=rewards.prm_type, device=device,
                                  dtype=config.model.dtype, adapter_path=rewards.prm_checkpoint_path,
                                  kv_cache_mb=rewards.prm_kv_cache_mb, **prm_marker(rewards))
    if name == "target":
        return build_target_solver(config, device, policy_template)
    raise ValueError(f"unknown reward source {name!r}; known: outcome, prm, target, steps")


def build_target_solver(config: RunConfig, device: str, policy_template: str) -> RewardModel:
    """The 'target' source: the frozen target (a served one, or a local model) finishing each prefix, its
    prompt in the configured template kind (a local target's own chat template under ``chat``)."""
    from reward_models.target_solver import TargetSolver

    target, services, env = config.prefix_rl, config.services, config.env
    if services.target_url is not None:
        from models.vllm_server import ServerGenerator

        generator = ServerGenerator(services.target_url, services.target_model_name, settings=services.client,
                                    model_flag="--target_model_name")
        template = policy_template  # a served target's tokenizer is not here: it reads the policy's prompt
    else:
        solver = language_policy(target.target_model, config.model, device)
        generator = make_generator(Backend.HF, solver)
        template = build_template(env.prompt_template, solver.tokenizer, env.system_prompt, env.answer_instruction)
    return TargetSolver(generator, num_samples=target.target_num_samples, max_new_tokens=target.target_max_new_tokens,
                        temperature=target.target_temperature, seed=config.budget.seed, template=template)


def prm_marker(rewards: RewardConfig) -> dict[str, str]:
    """The PRM's step tag as its argument: a shepherd PRM's step tag, or a classifier PRM's separator."""
    if rewards.prm_step_tag is None:
        return {}
    return {"step_tag" if rewards.prm_type == PrmType.SHEPHERD else "separator": rewards.prm_step_tag}


def problem_source(env: EnvConfig, split: str, eval_path: str | None = None) -> dict:
    """Where the train (split "train") or a held-out ("test") env's problems come from; ``eval_path``: a
    held-out set's own file (None: the env's test split, or --dataset_path)."""
    if env.dataset_path is not None:
        source = {"dataset_path": (eval_path or env.dataset_path) if split == "test" else env.dataset_path}
        return source if env.dataset_name is None else {**source, "subjects": [env.dataset_name]}
    if eval_path is not None and split == "test":
        return {"dataset_path": eval_path, "arith": None, "reasoning_gym": None}
    return {"split": split}


def env_kwargs(config: RunConfig, split: str, reward_model: RewardModel, tokenizer, template: str,
               eval_path: str | None = None) -> dict:
    """Task kwargs of the train (split "train") or a held-out ("test", from ``eval_path``: see
    ``problem_source``) vector env; ``tokenizer`` is the policy's (it decodes token actions, and its EOS text
    ends a step-level episode), ``template`` its prompt template (``models.prompting.build_template``), for
    every role of a workflow. A multi-agent env takes whole messages, plays the resolved workflow (its roles
    frozen by --frozen_role) and credits its 'outcome' source by ``reward_assignment``. The user's
    ``env_kwargs`` come first: what the trainer sets (the problem source of a held-out set, a solution-level
    action's one step) wins."""
    env, handoff_steps = config.env, config.prefix_rl.handoff_steps
    source = problem_source(env, split, eval_path)
    if env.workflow is not None:
        rollout_mode = config.multi_agent.rollout_mode if split == "train" else RolloutMode.INDEPENDENT
        return {**env.user_kwargs, "workflow": env.workflow, "reward_assignment": config.multi_agent.reward_assignment,
                "rollout_mode": rollout_mode, "reward_model": reward_model, "template": template, **source}
    kwargs = {**env.user_kwargs, "reward_model": reward_model, "template": template, **source,
              **tool_kwargs(env, tokenizer)}
    if handoff_steps is not None:
        kwargs["handoff_steps"] = handoff_steps
    if env.action_level == ActionLevel.SOLUTION:
        kwargs["max_steps"] = 1  # the action is the whole solution
    elif env.action_level == ActionLevel.STEP:
        kwargs["end_marker"] = tokenizer.eos_token or ""  # a step that ended on EOS ends the episode
    else:
        kwargs.update(mode=ActionLevel.TOKEN, tokenizer=tokenizer)
    return kwargs


def tool_kwargs(env: EnvConfig, tokenizer) -> dict:
    """The tool's env keywords: ``tools`` wherever the run or the env decides it (None turns an id's tool off),
    and with a tool its limits given as options and the tool turn of the policy's prompt template."""
    if env.tools == Tool.NONE:
        own = {**gymnasium.spec(env.env_id).kwargs, **env.user_kwargs}.get("tools")
        return {} if own is None else {"tools": None}
    limits = {"max_tool_calls": env.max_tool_calls, "max_tool_output_chars": env.max_tool_output_chars,
              "tool_timeout_s": env.tool_timeout}
    return {"tools": env.tools.value, "tool_turn": tool_turn_template(env.prompt_template, tokenizer),
            **{key: value for key, value in limits.items() if value is not None}}


def build_envs(config: RunConfig, reward_model: RewardModel, tokenizer, template: str, ranks: Ranks = Ranks()
               ) -> tuple[gymnasium.vector.VectorEnv, dict[str | None, gymnasium.vector.VectorEnv]]:
    """(train env, {held-out set's name: its eval env}, in ``env.eval_sets``' order). Episodic algorithms run one
    episode per env per iteration (no autoreset); continuing ones reset an ended episode in the same step. Under
    torchrun the train env holds this rank's whole groups (``distributed.shard``), drawing the problems one process
    would. With a tool each env has a sandbox of its own: local processes, or --tool_url's service."""
    env, services = config.env, config.services
    autoreset = AutoresetMode.DISABLED if env.whole_episodes else AutoresetMode.SAME_STEP
    first, count = distributed.shard(env.envs_stepped, env.group_size, ranks)
    split = ({"group_offset": first // env.group_size, "total_groups": env.envs_stepped // env.group_size}
             if ranks.distributed else {})

    def make(split_name: str, eval_path: str | None = None, **vector: Any) -> gymnasium.vector.VectorEnv:
        kwargs = env_kwargs(config, split_name, reward_model, tokenizer, template, eval_path)
        if env.tools != Tool.NONE and services.tool_url is not None:
            from models.remote_sandbox import RemoteSandbox  # the HTTP client: only with --tool_url

            kwargs["sandbox"] = RemoteSandbox(
                services.tool_url, timeout_s=kwargs.get("tool_timeout_s", TOOL_TIMEOUT_S),
                max_output_chars=kwargs.get("max_tool_output_chars", MAX_TOOL_OUTPUT_CHARS), settings=services.client)
        return gymnasium.make_vec(env.env_id, vectorization_mode="vector_entry_point", **vector, **kwargs)

    train_env = make("train", num_envs=count, group_size=env.group_size, autoreset_mode=autoreset, **split)
    eval_envs = {eval_set.name: make("test", eval_set.path, num_envs=config.budget.eval_batch_size, group_size=1,
                                     autoreset_mode=AutoresetMode.DISABLED)
                 for eval_set in env.eval_sets}
    if env.tools != Tool.NONE:
        log.info("the %s tool runs in: %s", env.tools, train_env.unwrapped.task.sandbox.describe_isolation())
    return train_env, eval_envs


def algorithm_config(config: RunConfig, ranks: Ranks = Ranks()) -> AlgorithmConfig:
    """The algorithms' hyper-parameters: the options the learning, PRIME and multi-agent sections take from
    ``algorithms.config``, as given; under torchrun RLOO keeps its share of the filtered groups on each rank."""
    sections = ((config.learning, LossOptions), (config.prime, PrimeOptions), (config.multi_agent, MultiAgentOptions))
    given = {part.name: getattr(section, part.name) for section, options in sections
             for part in dataclasses.fields(options)}
    prompt_groups = config.learning.prompt_groups
    return AlgorithmConfig(**given, max_groups=None if prompt_groups is None else prompt_groups // ranks.world_size)


def build_algorithm(config: RunConfig, ranks: Ranks = Ranks()) -> Algorithm:
    """The algorithm; under torchrun batch statistics are taken over every rank's part."""
    algorithm = make_algorithm(config.learning.algorithm, algorithm_config(config, ranks))
    if ranks.distributed:
        algorithm.reduce_sum = distributed.all_reduce_tensor
    return algorithm


def build_optimizer(learning: LearningConfig, policy: LanguagePolicy, iterations: int, lr: float | None = None,
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the policy's parameter groups at ``lr`` (None: --lr), and the lr schedule (after the warm-up
    iterations).

    The fused kernel updates each parameter in one pass; the per-parameter loop torch picks on a CPU
    allocates two temporaries of the parameter's size on the way (about 1 GB for a 151,936 x 896
    embedding), at the moment the run's memory peaks: weights, gradients and both moments alive."""
    optimizer = torch.optim.AdamW(policy.param_groups(lr or learning.lr, learning.critic_lr), weight_decay=0.0,
                                  fused=True)

    def factor(iteration: int) -> float:  # a function: LambdaLR's state_dict then holds no copy of it
        return lr_factor(iteration, learning.warmup_iterations, learning.lr_schedule, iterations)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lr_factor(step: int, warmup: int, schedule: LrSchedule, iterations: int) -> float:
    """The lr's multiplier at the ``step``-th update (from 0): linear warm-up over ``warmup`` updates, starting
    at 1 / warmup (not at 0: the first update moves the weights), then constant or linear decay to 0 at
    ``iterations``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == LrSchedule.LINEAR:
        return max(0.0, 1.0 - (step - warmup) / max(iterations - warmup, 1))
    return 1.0


def build_generators(config: RunConfig, policy: LanguagePolicy, directory: str, sync_dir: Path,
                     generator_factory: GeneratorFactory | None = None,
                     ) -> tuple[Generator, LanguagePolicy | None, Generator | None]:
    """(the policy's generator: ``generator_factory(policy)`` or the configured backend's, synced to the
    policy; the asynchronous rollout copy and its HF generator, or None, None). ``sync_dir``: where weights
    are written for vLLM servers to load, and role adapters for the in-process vLLM engine."""
    generation, services, model = config.generation, config.services, config.model
    if generator_factory is not None:
        generator = generator_factory(policy)
    elif generation.backend == Backend.VLLM_SERVER:
        from models.vllm_server import ServerGenerator

        generator = ServerGenerator(services.vllm_url, services.vllm_model_name, tokenizer=policy.tokenizer,
                                    sync_dir=sync_dir, settings=services.client, model_flag="--vllm_model_name",
                                    role_adapters=policy.role_adapters)
        generator.sync(policy)
    elif generation.backend == Backend.VLLM:
        generator = make_generator(Backend.VLLM, policy, sync_dir=sync_dir)
    else:
        generator = make_generator(generation.backend, policy)
    if not generation.async_rollouts:
        return generator, None, None
    with_critic = algorithm_spec(config.learning.algorithm).critic is not None
    # The copy only samples: under bfloat16 it holds bfloat16 weights, no fp32 master copy (half the memory);
    # its rollout log-probs are recorded at generation, so the update's ratios correct for it as for vLLM's.
    rollout_policy = language_policy(directory, model, policy.device, lora_rank=model.lora_rank,
                                     with_critic=with_critic, low_precision_weights=model.dtype == DType.BFLOAT16,
                                     role_adapters=policy.role_adapters, value_heads=max(policy.num_value_heads, 1))
    rollout_policy.load_state_dict(policy.whole_state_dict())  # sharded: every rank gathers
    return generator, rollout_policy, make_generator(Backend.HF, rollout_policy)


def build_role_models(config: RunConfig, env, policy: LanguagePolicy, sampling: Sampling,
                      members: Sequence[Member] = ()) -> RoleModels:
    """What generates for each agent slot: its role adapter (per-role adapters), a frozen role's own model (an HF
    generator sampled as the target is: the target's max new tokens and temperature), a member's generator
    (sampled as the policy is), else the policy."""
    models, slots = config.multi_agent.models_by_role, dict(enumerate(env.agents.roles))
    frozen = {slot: make_generator(Backend.HF, language_policy(models[role], config.model, policy.device))
              for slot, role in slots.items() if role in models}
    target_sampling = dataclasses.replace(sampling, max_new_tokens=config.prefix_rl.target_max_new_tokens,
                                          temperature=config.prefix_rl.target_temperature)
    member_slots = {slot: member for slot, role in slots.items() for member in members if member.role == role}
    return RoleModels(
        adapters={slot: role for slot, role in slots.items() if role in policy.role_adapters},
        generators={**frozen, **{slot: member.generator for slot, member in member_slots.items()}},
        samplings={slot: target_sampling for slot in frozen},
        members={slot: member.role for slot, member in member_slots.items()})


def build_members(config: RunConfig, device: torch.device) -> list[Member]:
    """The roles on base models of their own (--role_base_model), each with its LoRA rank (--role_lora_rank,
    default --lora_rank), optimizer at its lr (--role_lr, default --lr) on the policy's schedule, and HF generator;
    each logs its memory line."""
    multi_agent = config.multi_agent
    lrs, ranks = multi_agent.lrs_by_role, multi_agent.lora_ranks_by_role
    members = []
    for role, directory in multi_agent.base_models_by_role.items():
        policy = language_policy(directory, config.model, device, lora_rank=ranks.get(role, config.model.lora_rank),
                                 trained=True)
        optimizer, scheduler = build_optimizer(config.learning, policy, config.budget.num_iterations, lrs.get(role))
        members.append(Member(role, policy, optimizer, scheduler, make_generator(Backend.HF, policy)))
        log.info("%s", memory_line(f"member {role}", policy))
    return members


def build_parallel_module(team: Team, ranks: Ranks, data_parallel: DataParallel) -> torch.nn.Module:
    """The module the update calls: the team (the policy and its members), or under torchrun the team with its
    policy sharded with FSDP2 (``data_parallel`` fsdp, or auto with full fine-tuning; with members auto resolves
    to ddp) or the team wrapped in DDP (ddp, or auto with LoRA; parameters a step leaves unused, such as an idle
    critic or a member without rows on this rank, are allowed). Gradients are averaged over ranks."""
    if not ranks.distributed:
        return team
    policy = team.policy
    if shards_weights(data_parallel, policy.lora.rank if policy.lora else 0, ranks):
        from torch.distributed.device_mesh import init_device_mesh

        policy.fully_shard(init_device_mesh(policy.device.type, (ranks.world_size,)))
        return team
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if policy.device.type == "cuda" else None
    return DistributedDataParallel(team, device_ids=device_ids, find_unused_parameters=True)


def sampling_of(generation: GenerationConfig, action_level: ActionLevel, eos_text: str) -> Sampling:
    """How rollouts sample: one token per action in token mode; a step stops at the step delimiter."""
    token_actions = action_level == ActionLevel.TOKEN
    return Sampling(max_new_tokens=1 if token_actions else generation.max_new_tokens,
                    temperature=generation.temperature, top_p=generation.top_p, eos_text=eos_text,
                    token_actions=token_actions, stop=(STEP_DELIMITER,) if action_level == ActionLevel.STEP else None)


def overlong_penalty(rollout: RolloutConfig, sampling: Sampling) -> OverlongPenalty | None:
    """DAPO's overlong penalty over the buffer before the action's token limit (None unless --overlong_buffer)."""
    if not rollout.overlong_buffer:
        return None
    return OverlongPenalty(sampling.max_new_tokens, rollout.overlong_buffer_len, rollout.overlong_penalty_factor)


def build_runner(config: RunConfig, run_dir: Path, writer, saved: checkpoint_files.Checkpoint | None = None,
                 generator_factory: GeneratorFactory | None = None, ranks: Ranks = Ranks()) -> Runner:
    """Every piece of a run from its config, composed into a Runner (restored from ``saved`` if given).
    ``writer`` is a tensorboardX SummaryWriter on ``run_dir`` (None on ranks other than 0);
    ``generator_factory`` builds the generation backend when the caller needs engine settings the config
    does not cover; ``ranks``: this process's place in a torchrun job. ``config`` is resolved first
    (``train.resolve.resolved``): options left None take the values the command line would give them.

    One GRPO iteration of the shipped tiny policy on Arith-v0 (four samples of one problem), as a library user
    runs it without flags:

    >>> import tempfile
    >>> from tensorboardX import SummaryWriter
    >>> from train.config import BudgetConfig, EnvConfig, GenerationConfig, LoggingConfig, ModelConfig
    >>> config = RunConfig(model=ModelConfig(device="cpu"), env=EnvConfig(num_envs=4),
    ...                    generation=GenerationConfig(max_new_tokens=16, async_rollouts=False),
    ...                    budget=BudgetConfig(num_iterations=1, eval_interval=0),
    ...                    logging=LoggingConfig(save_best=False))
    >>> with tempfile.TemporaryDirectory() as run_dir, SummaryWriter(run_dir) as writer:
    ...     runner = build_runner(config, Path(run_dir), writer)
    ...     try:
    ...         history = runner.run()  # collects, updates, saves the last checkpoint under run_dir
    ...     finally:
    ...         runner.close()
    >>> history  # the held-out evaluations: none with eval_interval=0
    []
    >>> runner.last_buffer.live.shape  # [T, N, A]: one step (a whole solution) of 4 envs, one agent
    torch.Size([1, 4, 1])
    """
    config = resolved(config)
    env, learning, data_parallel = config.env, config.learning, config.distributed.data_parallel
    directory = model_dir(config.model, env.workflow is not None)
    policy = build_policy(config.model, directory, learning.algorithm, ranks, data_parallel)
    log.info("%s", memory_line("policy", policy))
    members = build_members(config, policy.device)
    team = Team(policy, {member.role: member.policy for member in members})
    # first: under FSDP2 the ranks but 0 hold no weights until sharded, and the parameters become new objects
    parallel_module = build_parallel_module(team, ranks, data_parallel)
    template = build_template(env.prompt_template, policy.tokenizer, env.system_prompt, env.answer_instruction)
    reward_model = build_reward_model(config, str(policy.device), template)
    train_env, eval_envs = build_envs(config, reward_model, policy.tokenizer, template, ranks)
    sync_dir = Path(config.services.vllm_sync_dir or run_dir / "sync")
    if ranks.distributed:  # each rank writes (and its servers load) its own copy: no two writers on one path
        sync_dir = sync_dir / f"rank_{ranks.rank}"
    generator, rollout_policy, rollout_generator = build_generators(config, policy, directory, sync_dir,
                                                                    generator_factory)
    algorithm = build_algorithm(config, ranks)
    implicit_prm = None
    if algorithm.needs_process_rewards:
        implicit_prm = ImplicitPRM(language_policy(directory, config.model, str(policy.device),
                                                   lora_rank=config.model.lora_rank),
                                   beta=config.prime.implicit_prm_beta, lr=config.prime.implicit_prm_lr,
                                   grad_clip=config.prime.implicit_prm_grad_clip, norm=config.prime.prime_norm,
                                   granularity=config.prime.prime_granularity,
                                   credit=config.prime.process_credit_assignment,
                                   min_form_temperature=config.prime.min_form_temperature)
    optimizer, scheduler = build_optimizer(learning, policy, config.budget.num_iterations)
    sampling = sampling_of(config.generation, env.action_level, policy.tokenizer.eos_token or "")
    collector = Collector(train_env, algorithm_spec(learning.algorithm), env.episode_length, sampling,
                          seed=config.budget.seed,
                          env_offset=distributed.shard(env.envs_stepped, env.group_size, ranks)[0],
                          role_models=build_role_models(config, train_env, policy, sampling, members),
                          critic=learning.critic_view, overlong=overlong_penalty(config.rollout, sampling))
    runner = Runner(config, collector, eval_envs, team, generator, algorithm, optimizer, scheduler, writer,
                    run_dir, implicit_prm=implicit_prm, rollout_policy=rollout_policy,
                    rollout_generator=rollout_generator, ranks=ranks, parallel_module=parallel_module,
                    members=members)
    if saved is not None:
        runner.restore(saved)
    return runner
