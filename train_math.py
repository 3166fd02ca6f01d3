"""Train a language model on a gymnasium MATH env with APPO, GRPO, TPPO or RLOO.

    python train_math.py                      # tiny built-in policy on Arith-v0, GRPO, CPU
    python train_math.py --helpfull           # every flag
    python -u train_math.py --dataset_path ./math_500.jsonl --model_name_or_path ./Qwen2.5-Math-1.5B \\
        --prm_model_name_or_path ./Qwen2.5-Math-7B-Instruct --algorithm_name APPO --num_mini_batch 4 --ppo_epoch 1

Flags are parsed and validated (train/flags.py) before anything heavy is imported or loaded.
TensorBoard logs and checkpoints go to <logdir>/<experiment>/<run>; ``--resume auto`` continues the
newest complete checkpoint in the same run directory (train/checkpoint.py). SIGINT/SIGTERM save a
checkpoint after the current iteration and exit 0 with the command that resumes.
"""

from __future__ import annotations

import importlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

from absl import app, flags, logging

from train import flags as train_flags

FLAGS = train_flags.FLAGS


def check_env_id(env_id: str) -> None:
    """The id must be registered (importing ``module`` of ``module:EnvId`` first) with a vector
    entry point taking ``group_size`` (MathVectorEnv or compatible)."""
    import gymnasium

    import envs  # noqa: F401  (registers the built-in ids)

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


def build_reward_model(device: str, dtype: str):
    """The env's reward model from --reward: one source, or a weighted RewardMixture."""
    from reward_models.mixture import RewardMixture, parse_reward_spec
    from envs.rewards import OutcomeReward

    weights = parse_reward_spec(train_flags.resolved_reward(), train_flags.REWARD_SOURCES)
    models = {}
    for name in weights:
        if name == "outcome":
            models[name] = OutcomeReward()
        elif name == "steps":
            from reward_models.reference_steps import ReferenceStepsReward

            models[name] = ReferenceStepsReward()
        elif name == "prm":
            from reward_models.prm import ProcessRewardModel

            models[name] = ProcessRewardModel(FLAGS.prm_model_name_or_path, prm_type=train_flags.resolved_prm_type(),
                                              device=device, dtype=dtype, adapter_path=FLAGS.prm_checkpoint_path,
                                              kv_cache_mb=FLAGS.prm_kv_cache_mb)
        elif name == "target":
            from reward_models.target_solver import TargetSolver
            from train.models.generation import make_generator
            from train.models.policy import LanguagePolicy

            target = LanguagePolicy(FLAGS.target_model_name_or_path, device=device, dtype=dtype).eval()
            models[name] = TargetSolver(make_generator("hf", target), seed=FLAGS.seed)
    if len(weights) == 1 and next(iter(weights.values())) == 1.0:
        return next(iter(models.values()))
    return RewardMixture(models, weights)


def env_kwargs(split: str, reward_model, eos_text: str) -> dict:
    """Task kwargs of the train (split "train") or held-out ("test") vector env."""
    kwargs = {"reward_model": reward_model}
    if FLAGS.dataset_path is not None:
        kwargs["dataset_path"] = (FLAGS.eval_dataset_path or FLAGS.dataset_path) if split == "test" else FLAGS.dataset_path
        if FLAGS.dataset_name is not None:
            kwargs["subjects"] = [FLAGS.dataset_name]
    elif FLAGS.eval_dataset_path is not None and split == "test":
        kwargs["dataset_path"] = FLAGS.eval_dataset_path
        kwargs["arith"] = None
    else:
        kwargs["split"] = split
    if FLAGS.action_level == "solution":
        kwargs["max_steps"] = 1  # the action is the whole solution
    else:
        kwargs["end_marker"] = eos_text  # a step that ended on EOS ends the episode
    return kwargs


def lr_lambda(num_iterations: int):
    warmup, schedule = FLAGS.warmup_iterations, FLAGS.lr_schedule

    def factor(iteration: int) -> float:
        if iteration < warmup:
            return (iteration + 1) / warmup
        if schedule == "linear":
            return max(0.0, 1.0 - (iteration - warmup) / max(num_iterations - warmup, 1))
        return 1.0

    return factor


def prepare_run_dir(saved) -> Path:
    """The run directory: the resumed checkpoint's, else a new <logdir>/<experiment>/run_<time>.
    Created (and checked writable) before any model loads."""
    if saved is not None and saved.run_dir is not None:
        run_dir = saved.run_dir
    else:
        run_dir = Path(FLAGS.logdir) / train_flags.resolved_experiment_name() / time.strftime("run_%Y%m%d_%H%M%S")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise app.UsageError(f"--logdir={FLAGS.logdir}: cannot write to {run_dir} ({error.strerror}); "
                             "pass a writable --logdir") from error
    return run_dir


def open_writer(run_dir: Path, purge_step: int | None = None):
    """A TensorBoard writer for ``run_dir``. tensorboardX names event files by the second and the host
    only, so a resume within the same second as the run it continues would overwrite that run's file;
    a nanosecond suffix keeps the files apart and in time order (TensorBoard reads them in name order)."""
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(run_dir), purge_step=purge_step, filename_suffix=f".{time.time_ns()}")


def log_changed_flags(saved_flags: dict, current: dict) -> None:
    """Resuming with other flags is allowed (e.g. more --num_env_steps); the differences are logged."""
    changed = [f"--{name}={current[name]} (checkpoint: {saved_flags[name]})" for name in sorted(current)
               if name != "resume" and name in saved_flags and saved_flags[name] != current[name]]
    if changed:
        logging.warning("resuming with flags that differ from the checkpoint's: %s", ", ".join(changed))


def resume_command(path: Path) -> str:
    """This process's command line with ``--resume=<path>`` instead of any --resume it had."""
    args, skip_next = [], False
    for arg in sys.argv[1:]:
        if skip_next or arg.startswith(("--resume=", "-resume=")):
            skip_next = False
            continue
        skip_next = arg in ("--resume", "-resume")
        if not skip_next:
            args.append(arg)
    return shlex.join([sys.executable, sys.argv[0], *args, f"--resume={path}"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}; every setting is a --flag")
    train_flags.check_algorithm_specific()
    env_id = train_flags.resolved_env_id()
    check_env_id(env_id)

    import gymnasium
    import numpy as np
    import torch
    from gymnasium.vector import AutoresetMode

    from algorithms.base import AlgorithmConfig, make_algorithm
    from reward_models.implicit_prm import ImplicitPRM
    from train import checkpoint
    from train.models.generation import make_generator
    from train.models.policy import LanguagePolicy, LoraSettings, resolve_device
    from train.runner import Runner, RunnerConfig

    try:
        resume_path = checkpoint.resolve_resume(FLAGS.resume, Path(FLAGS.logdir) / train_flags.resolved_experiment_name())
    except checkpoint.CheckpointError as error:
        raise app.UsageError(str(error)) from error
    saved = checkpoint.load(resume_path) if resume_path is not None else None
    run_dir = prepare_run_dir(saved)
    if saved is not None:
        logging.info("resuming from %s (iteration %d)", saved.path, saved.iteration)
        checkpoint.retire_newer(saved)
        log_changed_flags(saved.flags, train_flags.flag_dict())

    torch.set_num_threads(FLAGS.torch_threads)
    torch.manual_seed(FLAGS.seed)
    np.random.seed(FLAGS.seed)
    algorithm_name = FLAGS.algorithm_name
    episodic = algorithm_name in train_flags.EPISODIC
    device = str(resolve_device(FLAGS.device))
    if FLAGS.model_name_or_path is not None:
        model_dir = FLAGS.model_name_or_path
    else:
        from train.tiny import build_tiny_models

        logging.info("no --model_name_or_path: using the built-in tiny policy (built and cached on first use)")
        model_dir = str(build_tiny_models().policy)

    lora = LoraSettings(rank=FLAGS.lora_rank, alpha=2.0 * FLAGS.lora_rank) if FLAGS.lora_rank else None
    with_critic = algorithm_name in train_flags.WITH_CRITIC
    policy_kwargs = dict(device=device, dtype=FLAGS.dtype, gradient_checkpointing=FLAGS.gradient_checkpointing)
    if saved is not None:
        policy = checkpoint.load_policy(saved, model_dir, lora, with_critic, **policy_kwargs)
    else:
        policy = LanguagePolicy(model_dir, lora=lora, with_critic=with_critic, **policy_kwargs)
    policy.eval()  # no dropout: recomputed log-probs must match the sampler's
    eos_text = policy.tokenizer.eos_token or ""

    reward_model = build_reward_model(device, FLAGS.dtype)
    group_size = train_flags.resolved_group_size()
    num_envs = FLAGS.n_rollout_threads * (FLAGS.oversample_factor if algorithm_name == "RLOO" else 1)
    autoreset = AutoresetMode.DISABLED if episodic else AutoresetMode.SAME_STEP
    env = gymnasium.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point",
                             group_size=group_size, autoreset_mode=autoreset, **env_kwargs("train", reward_model, eos_text))
    eval_env = gymnasium.make_vec(env_id, num_envs=FLAGS.eval_batch_size, vectorization_mode="vector_entry_point",
                                  group_size=1, autoreset_mode=AutoresetMode.DISABLED,
                                  **env_kwargs("test", reward_model, eos_text))

    generator = make_generator(FLAGS.generation_backend, policy)
    async_rollouts = train_flags.resolved_async_rollouts()
    rollout_policy = rollout_generator = None
    if async_rollouts:
        rollout_policy = LanguagePolicy(model_dir, lora=lora, with_critic=with_critic, **policy_kwargs).eval()
        rollout_policy.load_state_dict(policy.state_dict())
        rollout_generator = make_generator("hf", rollout_policy)

    config = AlgorithmConfig(
        clip_param=FLAGS.clip_param, value_clip_param=FLAGS.value_clip_param or None,
        huber_delta=FLAGS.huber_delta or None, value_coef=FLAGS.value_coef, entropy_coef=FLAGS.entropy_coef,
        gamma=FLAGS.gamma, gae_lambda=FLAGS.gae_lambda, scale_rewards=FLAGS.scale_rewards, kl_coef=FLAGS.kl_coef,
        loss_agg=FLAGS.loss_agg, process_coef=FLAGS.process_coef, accuracy_lower_bound=FLAGS.accuracy_lower_bound,
        accuracy_upper_bound=FLAGS.accuracy_upper_bound,
        max_groups=FLAGS.n_rollout_threads // group_size if FLAGS.oversample_factor > 1 else None)
    algorithm = make_algorithm(algorithm_name, config)
    implicit_prm = None
    if algorithm.needs_process_rewards:
        implicit_prm = ImplicitPRM(model_dir, beta=FLAGS.implicit_prm_beta, lr=FLAGS.implicit_prm_lr, device=device,
                                   dtype=FLAGS.dtype, lora=lora)

    episode_length = train_flags.resolved_episode_length()
    num_iterations = math.ceil(FLAGS.num_env_steps / (episode_length * FLAGS.n_rollout_threads))
    optimizer = torch.optim.AdamW(policy.param_groups(FLAGS.lr, FLAGS.critic_lr), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(num_iterations))

    start = saved.iteration if saved is not None else 0
    # purge_step: TensorBoard drops points a killed run logged at or after the checkpoint's iteration.
    writer = open_writer(run_dir, purge_step=start if saved is not None else None)
    settings = train_flags.flag_dict()
    resolved = {"env_id": env_id, "reward": train_flags.resolved_reward(), "episode_length": episode_length,
                "async_rollouts": async_rollouts, "group_size": group_size, "model_dir": model_dir, "num_iterations": num_iterations,
                "device": device, "resumed_from": str(saved.path) if saved is not None else None}
    writer.add_text("flags", "\n".join(f"    --{k}={v}" for k, v in settings.items()), start)
    writer.add_text("resolved", "\n".join(f"    {k}: {v}" for k, v in resolved.items()), start)
    logging.info("run directory %s; %s, %d iterations of %d envs x %d steps", run_dir, algorithm_name,
                 num_iterations, num_envs, episode_length)

    runner = Runner(
        RunnerConfig(num_iterations=num_iterations, episode_length=episode_length, max_new_tokens=FLAGS.max_new_tokens,
                     action_level=FLAGS.action_level, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                     num_mini_batch=FLAGS.num_mini_batch, ppo_epoch=FLAGS.ppo_epoch,
                     gradient_cp_steps=FLAGS.gradient_cp_steps, max_grad_norm=FLAGS.max_grad_norm,
                     target_kl=FLAGS.target_kl, eval_interval=FLAGS.eval_interval, eval_limit=FLAGS.eval_limit,
                     log_interval=FLAGS.log_interval, save_interval=FLAGS.save_interval, seed=FLAGS.seed,
                     async_rollouts=async_rollouts, max_policy_lag=FLAGS.max_policy_lag,
                     keep_checkpoints=FLAGS.keep_checkpoints, save_best=FLAGS.save_best,
                     max_nonfinite_steps=FLAGS.max_nonfinite_steps),
        env, eval_env, policy, generator, algorithm, optimizer, scheduler, writer, run_dir,
        implicit_prm=implicit_prm, rollout_policy=rollout_policy, rollout_generator=rollout_generator,
        run_flags=settings)
    if saved is not None:
        runner.restore(saved)
    history = runner.run()
    (run_dir / "eval_history.json").write_text(json.dumps(history, indent=1))
    if runner.stop_signal is not None:
        writer.close()
        print(f"stopped by {runner.stop_signal} after iteration {runner.iteration}: checkpoint "
              f"{runner.last_checkpoint}; resume with: {resume_command(runner.last_checkpoint)}", flush=True)
        return
    hparams = {k: v for k, v in {**settings, **resolved}.items() if isinstance(v, (int, float, str, bool))}
    final = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("eval/")}
    writer.add_hparams(hparams, final, name="hparams")  # no evaluation (--eval_interval 0): no metric columns
    writer.close()
    if history:
        best = max(history, key=lambda h: h["eval/accuracy"])
        logging.info("greedy accuracy: %.3f at the start -> %.3f at the end (%d evaluations); best %.3f at "
                     "iteration %d%s", history[0]["eval/accuracy"], history[-1]["eval/accuracy"], len(history),
                     best["eval/accuracy"], best["iteration"], f" ({run_dir / 'best'})" if FLAGS.save_best else "")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
