"""Train a language model on a gymnasium MATH env with APPO, GRPO, TPPO, RLOO (PRIME),
REINFORCE_PP or REINFORCE_PP_BASELINE (``algorithms.registry.ALGORITHMS``).

    python train_math.py                      # tiny built-in policy on Arith-v0, GRPO, CPU
    python train_math.py --help               # the main flags, grouped (--helpfull: every flag, by section)
    torchrun --standalone --nproc_per_node 2 train_math.py   # data-parallel over 2 ranks (train/distributed.py)
    python -u train_math.py --dataset_path ./math_500.jsonl --model_name_or_path ./Qwen2.5-Math-1.5B \\
        --prm_model_name_or_path ./math-shepherd-mistral-7b-prm --algorithm_name APPO --num_mini_batch 4 --ppo_epoch 1

Flags are parsed (train/flags.py); a resume gives the flags this command line left out their checkpoint's values;
then they are validated (train/validation.py, before anything heavy is imported or loaded) and resolved once
into a RunConfig (train/config.py), and the run is composed from it by train/builders.py.
TensorBoard logs and checkpoints go to <logdir>/<experiment>/<run>; ``--resume auto`` continues the
newest complete checkpoint in the same run directory (train/checkpoint_files.py). SIGINT, SIGTERM and
SIGUSR1 save a checkpoint after the current iteration and exit 75 (``STOPPED_TO_RESUME``) with the command
that resumes; the signals that follow are ignored, except Ctrl-C twice, which stops at once without saving.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from absl import app, flags, logging

from train import flags as train_flags

if TYPE_CHECKING:
    from train.checkpoint_files import Checkpoint
    from train.config import LoggingConfig, RunConfig
    from train.runner import Runner

FLAGS = train_flags.FLAGS


@dataclass(frozen=True)
class Started:
    """A run ready to train: its runner, TensorBoard writer (None off rank 0), run directory, the checkpoint it
    resumes (or None) and its resolved config."""

    runner: Runner
    writer: Any
    run_dir: Path
    saved: Checkpoint | None
    config: RunConfig


def prepare_run_dir(logs: LoggingConfig, saved, ranks) -> Path:
    """The run directory: the resumed checkpoint's, else a new <logdir>/<experiment>/run_<time> (rank 0's
    time under torchrun). Created and locked (``train.run_lock``: one writer per run; rank 0 holds it)
    before anything is written there and before any model loads."""
    from train import distributed, run_lock

    if saved is not None and saved.run_dir is not None:
        run_dir = saved.run_dir
    else:
        name = distributed.all_gather_objects(time.strftime("run_%Y%m%d_%H%M%S"))[0]
        run_dir = Path(logs.logdir) / logs.experiment_name / name
    problem: Exception | None = None
    if ranks.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            run_lock.acquire(run_dir)
        except OSError as error:
            problem = ValueError(f"--logdir={logs.logdir}: cannot write to {run_dir} ({error.strerror}); "
                                 "pass a writable --logdir")
        except run_lock.RunLockedError as error:
            problem = error
    problem = distributed.all_gather_objects(problem)[0]  # every rank stops when rank 0 cannot have the run
    if problem is not None:
        raise problem
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


def fail(*messages: str, code: int = 1) -> NoReturn:
    """The one format for every mistake a user can make before training starts (bad flags, files, model
    directories or checkpoints raise flags.Error, ValueError, OSError or CheckpointError) and for a
    server that stops answering (ServiceError): one line per message, no traceback, exit code 1. Under
    torchrun each line names the rank."""
    rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    for message in messages:
        print(f"{rank}train_math.py: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(code)


def caused_by(error: BaseException, kind: type) -> bool:
    """Whether ``error`` or an exception it was raised from is a ``kind`` (a reward model's ServiceError
    reaches the runner wrapped by the env)."""
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__
    return False


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with its errors in ``fail``'s format (one line each when several flags are wrong),
    and the project's grouped --help and --helpfull."""
    asked = [train_flags.HELP_FLAGS[arg] for arg in argv[1:] if arg in train_flags.HELP_FLAGS]
    if asked:
        print(train_flags.help_text(__doc__, full=any(asked)), end="")
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as error:
        errors = [line for line in str(error).splitlines() if line.strip()]
        fail(*errors[:-1], f"{errors[-1]} (--helpfull lists every flag)")


def after_service_failure(runner: Runner) -> str:
    """What to do after a server stopped answering: resume from the state saved at the failure, or (several
    ranks cannot join a save) from the last checkpoint with --resume auto."""
    if runner.saved_at_failure is not None:
        return (f"The state before the failure is saved; once the server is back, resume with: "
                f"{resume_command(runner.saved_at_failure)}")
    why = f" (its {runner.ranks.world_size} ranks cannot join a save)" if runner.ranks.distributed else ""
    return (f"Nothing was saved at the failure{why}; the last checkpoint is {runner.last_checkpoint or 'none yet'}. "
            "Once the server is back, launch the same command with --resume auto")


STOPPED_TO_RESUME = 75
"""Exit status of a run that a signal stopped after saving its checkpoint: sysexits.h's EX_TEMPFAIL ("a
temporary failure: try again"), so that a scheduler tells it from a finished run (0) and from a failure
(1), and requeues it (docs/distributed.md: a SLURM script; Kubernetes: a podFailurePolicy rule on it)."""


def main(argv: list[str]) -> None:
    from train import run_lock  # stdlib only

    try:
        code = train(argv)
    finally:
        run_lock.release_all()  # in-process callers (tests) may start the next run in this directory
    if code:
        sys.exit(code)


def train(argv: list[str]) -> int:
    """Starts or resumes the run and trains it; returns the exit status (0, or STOPPED_TO_RESUME)."""
    if len(argv) > 1:
        fail(f"unexpected positional arguments {argv[1:]}; every setting is a --flag")
    from models.remote import ServiceError  # stdlib only: cheap before the flags are checked
    from train.run_lock import RunLockedError

    try:
        saved = resumed()
        config = train_flags.config_from_flags(FLAGS)
        from train.checkpoint_files import CheckpointError  # torch and transformers: only once the flags resolve

        try:
            started = start(config, saved)
        except CheckpointError as error:
            fail(str(error))
    except KeyboardInterrupt:
        fail("interrupted during start-up; nothing was trained", code=130)
    except (flags.Error, ValueError, OSError, ServiceError, RunLockedError) as error:
        fail(*str(error).splitlines())  # validation refuses each wrong option on a line of its own
    if started is None:
        return 0
    runner = started.runner
    try:
        history = runner.run(exit_after_stop=True)
    except KeyboardInterrupt as interrupt:
        fail(f"{interrupt or 'interrupted'}; the last checkpoint is {runner.last_checkpoint or 'none'}", code=130)
    except CheckpointError as error:  # a full disk: what, where and what to do, on one line
        fail(str(error))
    except Exception as error:
        if not caused_by(error, ServiceError):
            raise
        fail(f"{error}. {after_service_failure(runner)}")
    finally:
        runner.close()
    if runner.stop_signal is not None:
        if runner.ranks.is_main:
            (started.run_dir / "eval_history.json").write_text(json.dumps(history, indent=1))
            started.writer.close()
            print(f"stopped by {runner.stop_signal} after iteration {runner.iteration}: checkpoint "
                  f"{runner.last_checkpoint}; resume with: {resume_command(runner.last_checkpoint)}", flush=True)
        return STOPPED_TO_RESUME
    if runner.ranks.is_main:
        (started.run_dir / "eval_history.json").write_text(json.dumps(history, indent=1))
        finish(started.writer, started.run_dir, history,
               {**runner.run_flags, **resolved_settings(started.config, runner, started.saved)},
               started.config.logging.save_best and not started.config.budget.val_only)
    return 0


def resumed() -> Checkpoint | None:
    """The checkpoint --resume names (None without --resume, or when ``--resume auto`` finds none). Every flag
    this command line left out takes its value there, so that the config, built after this, is the run's own."""
    if FLAGS.resume is None:
        return None
    from train import checkpoint_files  # torch: only a resume loads it before the config is built

    try:
        resume_path = checkpoint_files.resolve_resume(FLAGS.resume, train_flags.experiment_dir(FLAGS))
        saved = None if resume_path is None else checkpoint_files.load(resume_path)
    except checkpoint_files.CheckpointError as error:
        fail(str(error))
    if saved is not None:
        inherited = train_flags.inherit(saved.flags)
        if inherited:
            logging.info("resuming with the checkpoint's %s", ", ".join(f"--{n}={FLAGS[n].value}" for n in inherited))
    return saved


def start(config: RunConfig, saved: Checkpoint | None) -> Started | None:
    """Checks what can be checked before models load and builds the run, resuming ``saved`` (or None); None
    when that checkpoint has already trained the whole budget."""
    import numpy as np
    import torch

    from train import builders, checkpoint_files, distributed, host

    ranks = distributed.init(config.model.device, config.distributed.dist_timeout)
    if saved is not None and saved.iteration >= config.budget.num_iterations:
        print(f"{saved.path} has trained {saved.iteration} iterations and --num_env_steps="
              f"{config.budget.num_env_steps} asks for {config.budget.num_iterations}: nothing to do (raise "
              "--num_env_steps to train further)", flush=True)
        return None
    builders.check_inputs(config)
    run_dir = prepare_run_dir(config.logging, saved, ranks)
    try:
        if saved is not None:
            logging.info("resuming from %s (iteration %d)", saved.path, saved.iteration)
            if ranks.is_main:
                checkpoint_files.retire_newer(saved)
            log_changed_flags(saved.flags, config.flags)
        host.set_up(config.model)
        torch.manual_seed(config.budget.seed)
        np.random.seed(config.budget.seed)
        start_iteration = saved.iteration if saved is not None else 0
        # purge_step: TensorBoard drops points a killed run logged at or after the checkpoint's iteration.
        writer = (open_writer(run_dir, purge_step=start_iteration if saved is not None else None)
                  if ranks.is_main else None)  # rank 0 alone logs
        runner = builders.build_runner(config, run_dir, writer, saved, ranks=ranks)
    except BaseException:
        if saved is None and ranks.is_main:  # a run that never started leaves no directory behind
            remove_run_dir(run_dir, ranks.distributed)
        raise
    if ranks.is_main:
        resolved = resolved_settings(config, runner, saved)
        writer.add_text("flags", "\n".join(f"    --{k}={v}" for k, v in runner.run_flags.items()), start_iteration)
        writer.add_text("resolved", "\n".join(f"    {k}: {v}" for k, v in resolved.items()), start_iteration)
    logging.info("run directory %s; %s, %d iterations of %d envs x %d steps%s", run_dir, config.learning.algorithm,
                 runner.config.budget.num_iterations, runner.collector.env.num_envs, runner.collector.episode_length,
                 f" on each of {ranks.world_size} ranks" if ranks.distributed else "")
    return Started(runner, writer, run_dir, saved, config)


def remove_run_dir(run_dir: Path, distributed: bool) -> None:
    """Removes a run directory that never started, and its experiment directory if that is left empty."""
    shutil.rmtree(run_dir, ignore_errors=distributed)
    experiment = run_dir.parent
    if experiment.is_dir() and not any(experiment.iterdir()):
        experiment.rmdir()


def resolved_settings(config: RunConfig, runner: Runner, saved: Checkpoint | None) -> dict:
    """The settings the flags left to be worked out (logged as TensorBoard text and hparams)."""
    return {"env_id": config.env.env_id, "reward": config.rewards.spec,
            "episode_length": runner.collector.episode_length,
            "async_rollouts": runner.config.generation.async_rollouts,
            "group_size": config.env.group_size, "model_dir": str(runner.policy.model_dir),
            "num_iterations": runner.config.budget.num_iterations, "device": str(runner.policy.device),
            "resumed_from": str(saved.path) if saved is not None else None}


def finish(writer, run_dir: Path, history: list[dict], settings: dict, save_best: bool) -> None:
    """Writes the hparams summary and logs the start, end and best held-out accuracy."""
    hparams = {k: v for k, v in settings.items() if isinstance(v, (int, float, str, bool))}
    final = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("eval/")}
    writer.add_hparams(hparams, final, name="hparams")  # no evaluation (--eval_interval 0): no metric columns
    writer.close()
    if history:
        best = max(history, key=lambda h: h["eval/accuracy"])
        logging.info("greedy accuracy: %.3f at the start -> %.3f at the end (%d evaluations); best %.3f at "
                     "iteration %d%s", history[0]["eval/accuracy"], history[-1]["eval/accuracy"], len(history),
                     best["eval/accuracy"], best["iteration"], f" ({run_dir / 'best'})" if save_best else "")


def run() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
