"""Builders: parsed flags in, the pieces of a training run out, and ``build_runner`` composing them.

Each builder reads the flags it needs from an absl ``FlagValues`` (``train.flags``), so train_math.py,
the benchmarks and the tests build a run the same way. ``build_envs`` is where a process's share of
the environments is decided.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable

import gymnasium
import torch
from absl import flags
from gymnasium.vector import AutoresetMode

import envs  # noqa: F401  (registers the built-in ids)
from algorithms.base import Algorithm, AlgorithmConfig, make_algorithm
from algorithms.registry import algorithm_spec
from envs.datasets import load_problems
from envs.prompts import STEP_DELIMITER
from envs.rewards import OutcomeReward, RewardMixture, RewardModel
from reward_models.implicit_prm import ImplicitPRM
from train import checkpoint, distributed
from train import flags as train_flags
from train.collector import Collector, Sampling, Voices
from train.distributed import Ranks
from models.generation import Generator, make_generator
from models.policy import LanguagePolicy, LoraSettings, check_model_dir, resolve_device
from models.remote import ClientSettings, ServiceClient, ServiceError
from train.runner import Runner, RunnerConfig

log = logging.getLogger(__name__)

GeneratorFactory = Callable[[LanguagePolicy], Generator]


def model_dir(f: flags.FlagValues) -> str:
    """--model_name_or_path, or the built-in tiny policy (built and cached on first use): on a multi-agent
    env the tiny team model, which has learned the built-in workflows' roles."""
    if f.model_name_or_path is not None:
        return f.model_name_or_path
    from models.tiny import build_tiny_models  # the build tool loads only when it is needed

    kind = "policy" if train_flags.workflow_of(f) is None else "team"
    log.info("no --model_name_or_path: using the built-in tiny %s (built and cached on first use)", kind)
    return str(getattr(build_tiny_models(team=kind == "team"), kind))


def check_inputs(f: flags.FlagValues) -> None:
    """What can be checked before any model loads: the device exists, every model directory holds a config,
    weights and a tokenizer, and the datasets read and select at least one problem. Raises ValueError
    naming the flag (and file and line) and the fix."""
    resolve_device(f.device)
    for role in ("model_name_or_path", "target_model_name_or_path"):
        if f[role].value is not None:
            check_model_dir(f[role].value, f"--{role}")
    for role, directory in train_flags.role_models(f).items():
        check_model_dir(directory, f"--role_model {role}")
    if f.prm_model_name_or_path is not None:
        from reward_models.prm import check_prm_dir

        check_prm_dir(f.prm_model_name_or_path, train_flags.resolved_prm_type(f), role="--prm_model_name_or_path",
                      **prm_marker(f))
    for service in ("target", "prm", "vllm"):
        url, name = f[f"{service}_url"].value, f[f"{service}_model_name"].value
        if url is not None:
            try:
                ServiceClient(url, client_settings(f)).check(name)
            except ServiceError as error:
                raise ServiceError(f"--{service}_url: {error}") from error
    subjects = [f.dataset_name] if f.dataset_name is not None else None
    for role in ("dataset_path", "eval_dataset_path"):
        if f[role].value is not None and not f[role].value.startswith("hf://"):  # hub datasets load once, later
            try:
                load_problems(f[role].value, subjects=subjects if role == "dataset_path" else None)
            except ValueError as error:
                raise ValueError(f"--{role}: {error}") from error


def client_settings(f: flags.FlagValues) -> ClientSettings:
    """How the clients of --target_url, --prm_url and --vllm_url wait and retry."""
    return ClientSettings(connect_timeout=f.service_connect_timeout, read_timeout=f.service_read_timeout,
                          retries=f.service_retries, backoff=f.service_backoff, max_backoff=30.0,
                          max_in_flight=f.service_max_in_flight)


def lora_settings(f: flags.FlagValues) -> LoraSettings | None:
    return LoraSettings(rank=f.lora_rank, alpha=2.0 * f.lora_rank) if f.lora_rank else None


def build_policy(f: flags.FlagValues, model: str) -> LanguagePolicy:
    """The trained policy (with a critic for APPO/TPPO) at its starting weights (a resumed run loads its
    checkpoint's into it: ``Runner.restore``); in eval mode (no dropout: recomputed log-probs must match
    the sampler's)."""
    with_critic = algorithm_spec(f.algorithm_name).critic is not None
    return LanguagePolicy(model, lora=lora_settings(f), with_critic=with_critic, device=str(resolve_device(f.device)),
                          dtype=f.dtype, gradient_checkpointing=f.gradient_checkpointing,
                          role_adapters=role_adapters(f), value_heads=train_flags.value_heads(f)).eval()


def build_reward_model(f: flags.FlagValues, device: str) -> RewardModel:
    """The env's reward model from --reward: one source, or a weighted RewardMixture (on a multi-agent env
    its 'outcome' source is the --reward_assignment credit)."""
    weights = train_flags.reward_weights(f)
    models = {name: build_reward_source(f, name, device) for name in weights}
    if len(weights) == 1 and next(iter(weights.values())) == 1.0:
        return next(iter(models.values()))
    return RewardMixture(models, weights)


def build_reward_source(f: flags.FlagValues, name: str, device: str) -> RewardModel:
    """One --reward source; the model-based ones load only when asked for."""
    if name == "outcome":
        return OutcomeReward()
    if name == "steps":
        from reward_models.reference_steps import ReferenceStepsReward

        return ReferenceStepsReward()
    if name == "prm" and f.prm_url is not None:
        from reward_models.remote import RemotePRM

        return RemotePRM(f.prm_url, f.prm_model_name, settings=client_settings(f))
    if name == "prm":
        from reward_models.prm import ProcessRewardModel

        return ProcessRewardModel(f.prm_model_name_or_path, prm_type=train_flags.resolved_prm_type(f), device=device,
                                  dtype=f.dtype, adapter_path=f.prm_checkpoint_path, kv_cache_mb=f.prm_kv_cache_mb,
                                  **prm_marker(f))
    if name == "target":
        from reward_models.target_solver import TargetSolver

        if f.target_url is not None:
            from models.vllm_server import ServerGenerator

            generator = ServerGenerator(f.target_url, f.target_model_name, settings=client_settings(f),
                                        model_flag="--target_model_name")
        else:
            generator = make_generator("hf", LanguagePolicy(f.target_model_name_or_path, device=device,
                                                            dtype=f.dtype).eval())
        return TargetSolver(generator, num_samples=f.target_num_samples, max_new_tokens=f.target_max_new_tokens,
                            temperature=f.target_temperature, seed=f.seed)
    raise ValueError(f"unknown reward source {name!r}; known: {', '.join(train_flags.REWARD_SOURCES)}")


def prm_marker(f: flags.FlagValues) -> dict[str, str]:
    """--prm_step_tag as the PRM's argument: a shepherd PRM's step tag, or a classifier PRM's separator."""
    if f.prm_step_tag is None:
        return {}
    return {"step_tag" if train_flags.resolved_prm_type(f) == "shepherd" else "separator": f.prm_step_tag}


def problem_source(f: flags.FlagValues, split: str) -> dict:
    """Where the train (split "train") or held-out ("test") env's problems come from."""
    if f.dataset_path is not None:
        source = {"dataset_path": (f.eval_dataset_path or f.dataset_path) if split == "test" else f.dataset_path}
        return source if f.dataset_name is None else {**source, "subjects": [f.dataset_name]}
    if f.eval_dataset_path is not None and split == "test":
        return {"dataset_path": f.eval_dataset_path, "arith": None}
    return {"split": split}


def env_kwargs(f: flags.FlagValues, split: str, reward_model: RewardModel | None, tokenizer) -> dict:
    """Task kwargs of the train (split "train") or held-out ("test") vector env; ``tokenizer`` is the
    policy's (it decodes token actions, and its EOS text ends a step-level episode). A multi-agent env
    takes whole messages and credits its 'outcome' source by ``--reward_assignment``."""
    if train_flags.workflow_of(f) is not None:
        return {"reward_assignment": f.reward_assignment, "reward_model": reward_model, **problem_source(f, split)}
    kwargs = {"reward_model": reward_model, **problem_source(f, split)}
    if f.handoff_steps is not None:
        kwargs["handoff_steps"] = f.handoff_steps
    if f.action_level == "solution":
        kwargs["max_steps"] = 1  # the action is the whole solution
    elif f.action_level == "step":
        kwargs["end_marker"] = tokenizer.eos_token or ""  # a step that ended on EOS ends the episode
    else:
        kwargs.update(mode="token", tokenizer=tokenizer)
    return kwargs


def build_envs(f: flags.FlagValues, reward_model: RewardModel | None, tokenizer, ranks: Ranks = Ranks(),
               ) -> tuple[gymnasium.vector.VectorEnv, gymnasium.vector.VectorEnv]:
    """(train env, held-out eval env). Episodic algorithms run one episode per env per iteration (no
    autoreset); continuing ones reset an ended episode in the same step. Under torchrun the train env
    holds this rank's whole groups (``distributed.shard``), drawing the problems one process would."""
    name = train_flags.registered_env_id(f)
    autoreset = AutoresetMode.DISABLED if train_flags.whole_episodes(f) else AutoresetMode.SAME_STEP
    total, group_size = train_flags.num_train_envs(f), train_flags.resolved_group_size(f)
    first, count = distributed.shard(total, group_size, ranks)
    split = {"group_offset": first // group_size, "total_groups": total // group_size} if ranks.distributed else {}
    env = gymnasium.make_vec(name, num_envs=count, vectorization_mode="vector_entry_point", group_size=group_size,
                             autoreset_mode=autoreset, **split, **env_kwargs(f, "train", reward_model, tokenizer))
    eval_env = gymnasium.make_vec(name, num_envs=f.eval_batch_size, vectorization_mode="vector_entry_point",
                                  group_size=1, autoreset_mode=AutoresetMode.DISABLED,
                                  **env_kwargs(f, "test", reward_model, tokenizer))
    return env, eval_env


def build_algorithm(f: flags.FlagValues, ranks: Ranks = Ranks()) -> Algorithm:
    """The algorithm of --algorithm_name; under torchrun RLOO keeps its share of the filtered groups on
    each rank, and batch statistics are taken over every rank's part."""
    config = AlgorithmConfig(
        clip_param=f.clip_param, value_clip_param=f.value_clip_param or None, huber_delta=f.huber_delta or None,
        value_coef=f.value_coef, entropy_coef=f.entropy_coef, gamma=f.gamma, gae_lambda=f.gae_lambda,
        value_lambda=f.value_lambda, scale_rewards=f.scale_rewards, kl_coef=f.kl_coef, loss_agg=f.loss_agg,
        process_coef=f.process_coef, accuracy_lower_bound=f.accuracy_lower_bound,
        accuracy_upper_bound=f.accuracy_upper_bound,
        max_groups=(f.n_rollout_threads // train_flags.resolved_group_size(f) // ranks.world_size
                    if f.oversample_factor > 1 else None), joint_groups=f.agent_groups == "joint")
    algorithm = make_algorithm(f.algorithm_name, config)
    if ranks.distributed:
        algorithm.reduce_sum = distributed.all_reduce_tensor
    return algorithm


def build_optimizer(f: flags.FlagValues, policy: LanguagePolicy, iterations: int,
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the policy's parameter groups, and the --lr_schedule (after --warmup_iterations)."""
    warmup, schedule = f.warmup_iterations, f.lr_schedule

    def factor(iteration: int) -> float:
        if iteration < warmup:
            return (iteration + 1) / warmup
        if schedule == "linear":
            return max(0.0, 1.0 - (iteration - warmup) / max(iterations - warmup, 1))
        return 1.0

    optimizer = torch.optim.AdamW(policy.param_groups(f.lr, f.critic_lr), weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_generators(f: flags.FlagValues, policy: LanguagePolicy, model: str, sync_dir: Path,
                     generator_factory: GeneratorFactory | None = None,
                     ) -> tuple[Generator, LanguagePolicy | None, Generator | None]:
    """(the policy's generator: ``generator_factory(policy)`` or --generation_backend's, synced to the policy;
    the asynchronous rollout copy and its HF generator, or None, None). ``sync_dir``: where weights are
    written for vLLM servers to load, and role adapters for the in-process vLLM engine."""
    if generator_factory is not None:
        generator = generator_factory(policy)
    elif f.generation_backend == "vllm_server":
        from models.vllm_server import ServerGenerator

        generator = ServerGenerator(f.vllm_url, f.vllm_model_name, tokenizer=policy.tokenizer, sync_dir=sync_dir,
                                    settings=client_settings(f), model_flag="--vllm_model_name",
                                    role_adapters=policy.role_adapters)
        generator.sync(policy)
    elif f.generation_backend == "vllm":
        generator = make_generator("vllm", policy, sync_dir=sync_dir)
    else:
        generator = make_generator(f.generation_backend, policy)
    if not train_flags.resolved_async_rollouts(f):
        return generator, None, None
    with_critic = algorithm_spec(f.algorithm_name).critic is not None
    rollout_policy = LanguagePolicy(model, lora=lora_settings(f), with_critic=with_critic, device=policy.device,
                                    dtype=f.dtype, gradient_checkpointing=f.gradient_checkpointing,
                                    role_adapters=policy.role_adapters,
                                    value_heads=max(policy.num_value_heads, 1)).eval()
    rollout_policy.load_state_dict(policy.state_dict())
    return generator, rollout_policy, make_generator("hf", rollout_policy)


def runner_config(f: flags.FlagValues) -> RunnerConfig:
    return RunnerConfig(
        num_iterations=train_flags.resolved_num_iterations(f), num_mini_batch=f.num_mini_batch, ppo_epoch=f.ppo_epoch,
        gradient_cp_steps=f.gradient_cp_steps, max_grad_norm=f.max_grad_norm, target_kl=f.target_kl,
        eval_interval=f.eval_interval, eval_limit=f.eval_limit, log_interval=f.log_interval,
        save_interval=f.save_interval, keep_checkpoints=f.keep_checkpoints, save_best=f.save_best,
        max_nonfinite_steps=f.max_nonfinite_steps, seed=f.seed, async_rollouts=train_flags.resolved_async_rollouts(f),
        max_policy_lag=f.max_policy_lag)


def role_adapters(f: flags.FlagValues) -> tuple[str, ...]:
    """The trained roles of a multi-agent --env_id, each with an adapter of its own (--noshare_policy)."""
    workflow = train_flags.workflow_of(f)
    if f.share_policy or workflow is None:
        return ()
    return tuple(role.name for role in workflow.roles if role.trainable)


def build_voices(f: flags.FlagValues, env, policy: LanguagePolicy, sampling: Sampling) -> Voices:
    """Who speaks for each agent slot: its role adapter (--noshare_policy), a frozen role's own model
    (--role_model, an HF generator sampled as the target is: --target_max_new_tokens, --target_temperature),
    else the policy."""
    models, slots = train_flags.role_models(f), dict(enumerate(env.agents.roles))
    own = [slot for slot, role in slots.items() if role in models]
    target_sampling = dataclasses.replace(sampling, max_new_tokens=f.target_max_new_tokens,
                                          temperature=f.target_temperature)
    return Voices(
        adapters={slot: role for slot, role in slots.items() if role in policy.role_adapters},
        generators={slot: make_generator("hf", LanguagePolicy(models[slots[slot]], device=str(policy.device),
                                                              dtype=f.dtype).eval()) for slot in own},
        samplings={slot: target_sampling for slot in own})


def build_trainable(policy: LanguagePolicy, ranks: Ranks, data_parallel: str) -> torch.nn.Module:
    """The module the update calls: the policy, or under torchrun the policy sharded with FSDP2
    (``data_parallel`` fsdp, or auto with full fine-tuning) or wrapped in DDP (ddp, or auto with LoRA;
    parameters a step leaves unused, such as an idle critic, are allowed). Gradients are averaged over ranks."""
    if not ranks.distributed:
        return policy
    if data_parallel == "fsdp" or (data_parallel == "auto" and policy.lora is None):
        from torch.distributed.device_mesh import init_device_mesh

        policy.fully_shard(init_device_mesh(policy.device.type, (ranks.world_size,)))
        return policy
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if policy.device.type == "cuda" else None
    return DistributedDataParallel(policy, device_ids=device_ids, find_unused_parameters=True)


def build_runner(f: flags.FlagValues, run_dir: Path, writer, saved: checkpoint.Checkpoint | None = None,
                 generator_factory: GeneratorFactory | None = None, ranks: Ranks = Ranks()) -> Runner:
    """Every piece of a run from the flags, composed into a Runner (restored from ``saved`` if given).
    ``writer`` is a tensorboardX SummaryWriter on ``run_dir`` (None on ranks other than 0);
    ``generator_factory`` builds the generation backend when the caller needs engine settings the flags
    do not cover; ``ranks``: this process's place in a torchrun job."""
    model = model_dir(f)
    policy = build_policy(f, model)
    env, eval_env = build_envs(f, build_reward_model(f, str(policy.device)), policy.tokenizer, ranks)
    sync_dir = Path(f.vllm_sync_dir) if f.vllm_sync_dir is not None else run_dir / "sync"
    if ranks.distributed:  # each rank writes (and its servers load) its own copy: no two writers on one path
        sync_dir = sync_dir / f"rank_{ranks.rank}"
    generator, rollout_policy, rollout_generator = build_generators(f, policy, model, sync_dir, generator_factory)
    algorithm = build_algorithm(f, ranks)
    implicit_prm = None
    if algorithm.needs_process_rewards:
        implicit_prm = ImplicitPRM(model, beta=f.implicit_prm_beta, lr=f.implicit_prm_lr, device=str(policy.device),
                                   dtype=f.dtype, lora=lora_settings(f))
    config = runner_config(f)
    trainable = build_trainable(policy, ranks, f.data_parallel)  # first: FSDP2 makes new parameter objects
    optimizer, scheduler = build_optimizer(f, policy, config.num_iterations)
    sampling = Sampling(max_new_tokens=1 if f.action_level == "token" else f.max_new_tokens, temperature=f.temperature,
                        top_p=f.top_p, eos_text=policy.tokenizer.eos_token or "", token_actions=f.action_level == "token",
                        stop=(STEP_DELIMITER,) if f.action_level == "step" else None)
    collector = Collector(env, algorithm_spec(f.algorithm_name), train_flags.resolved_episode_length(f), sampling,
                          seed=f.seed, env_offset=distributed.shard(train_flags.num_train_envs(f),
                                                                    train_flags.resolved_group_size(f), ranks)[0],
                          voices=build_voices(f, env, policy, sampling), critic=train_flags.critic_view(f))
    runner = Runner(config, collector, eval_env, policy, generator, algorithm, optimizer, scheduler, writer, run_dir,
                    implicit_prm=implicit_prm, rollout_policy=rollout_policy, rollout_generator=rollout_generator,
                    run_flags=train_flags.flag_dict(f), ranks=ranks, trainable=trainable)
    if saved is not None:
        runner.restore(saved)
    return runner
