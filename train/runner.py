"""The one training loop every algorithm shares. ``Runner.train_iteration`` calls the parts in the order the
data flows, each call returning what it produced, and keeps the counters (``RunProgress``) itself:

    evaluate when due (train.evaluation) -> collect the batch (Rollouts.next) -> score it with the reference
    and reward models (Learner.score) -> advantages (Learner.targets) -> minibatch steps (Learner.train)
    -> scheduler step -> implicit-PRM update under --prime_update after (Learner.update_implicit_prm_after)
    -> sync the generator
    -> log (train.reporting); between iterations, checkpoints (train.run_state).

Surviving faults:
- Checkpoints every ``save_interval`` iterations and at the end hold the weights, optimizer and
  scheduler, RNG states, the collector's state and the counters; ``restore`` continues from one exactly
  (synchronous collection: the same parameters and logged values as a run never stopped).
- SIGINT, SIGTERM and SIGUSR1 (what SLURM's ``--signal`` sends before a time limit): the current
  iteration finishes, a checkpoint is written, ``run`` returns with ``stop_signal`` set. Further ones are
  ignored (a duplicate must not abandon the save), except a second SIGINT, which interrupts at once
  (KeyboardInterrupt).
- ``max_nonfinite_steps`` non-finite optimizer steps in a row raise ``NonFiniteError`` without saving,
  naming the last checkpoint (the last good state).
- An exception before the update (a reward model raising in evaluation or collection, in this thread
  or in the rollout thread) writes a checkpoint of the state at the start of that iteration, then
  propagates (``saved_at_failure``). A generator that fails to take the updated weights saves the
  updated state the same way. Under torchrun the other ranks cannot join a save: nothing is written, and
  the last checkpoint stays the one to resume.

Data parallelism (``train.distributed``): ``parallel_module`` is the module the optimizer steps (the policy
wrapped in DDP, or under FSDP2 the sharded policy itself); statistics,
evaluation results and the stop signal are reduced over ranks; rank 0 alone logs and writes checkpoints,
which hold every rank's collector state and RNGs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from algorithms.base import Algorithm
from algorithms.buffer import RolloutBuffer
from models.generation import Generator
from models.policy import LanguagePolicy
from models.team import Team
from train import checkpoint_files, distributed, evaluation
from train.run_state import Checkpointer, RunProgress, Snapshot
from train.collector import Collector
from train.distributed import Ranks
from train.evaluation import EvalSampling
from train.config import RunConfig
from train.learner import Learner, NonFiniteError
from train.members import Member
from train.reporting import Reporter, bar_summary
from train.rollouts import Rollouts

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "RunProgress", "Runner"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
"""Signals that stop the run after the current iteration, with a checkpoint: Ctrl-C, a scheduler's stop
(SLURM at the time limit or on preemption, Kubernetes), SLURM's ``--signal=USR1@<seconds>`` warning."""


NUM_TEXT_SAMPLES = 4
"""Transcripts logged as TensorBoard text per logged iteration."""


class Runner:
    """Drives training; see the module docstring. ``config``: the run's resolved configuration
    (``train.resolve.resolved``), whose budget, learning, rollout, generation and logging sections it reads;
    ``eval_envs``: {held-out set's name (None: the one unnamed set): a vector env over its problems (group
    size 1)}, the first one's greedy accuracy picking the best checkpoint; ``rollout_policy``/
    ``rollout_generator`` are the copy used by asynchronous collection (required with asynchronous rollouts)."""

    def __init__(self, config: RunConfig, collector: Collector, eval_envs: dict[str | None, Any], team: Team,
                 generator: Generator, algorithm: Algorithm, optimizer: torch.optim.Optimizer, scheduler, writer,
                 run_dir: Path, implicit_prm=None, rollout_policy: LanguagePolicy | None = None,
                 rollout_generator: Generator | None = None, ranks: Ranks = Ranks(),
                 parallel_module: torch.nn.Module | None = None, members: Sequence[Member] = ()):
        budget, generation, logs = config.budget, config.generation, config.logging
        if generation.async_rollouts and (rollout_policy is None or rollout_generator is None):
            raise ValueError("async_rollouts needs rollout_policy and rollout_generator (a copy of the policy)")
        if algorithm.needs_process_rewards and implicit_prm is None:
            raise ValueError(f"{algorithm.name} needs an implicit PRM for its process rewards")
        if set(team.members) != {member.role for member in members}:
            raise ValueError(f"the team's members {sorted(team.members)} are not the members given "
                             f"{sorted(member.role for member in members)}: build the team from them")
        policy = team.policy
        self.config, self.collector, self.eval_envs, self.ranks = config, collector, eval_envs, ranks
        self.policy, self.generator, self.algorithm, self.members = policy, generator, algorithm, tuple(members)
        self.run_flags = config.flags  # saved with every checkpoint
        # an ended held-out episode's verdict: "correct", or "target" (a reward source) where a frozen target finishes
        # the policy's prefix (Prefix-RL by --handoff_steps), so that evaluation measures what the reward pays
        self.eval_verdict = "target" if config.prefix_rl.handoff_steps is not None else "correct"
        self.eval_sampling = EvalSampling(budget.eval_samples, budget.eval_temperature, budget.eval_top_p, budget.seed)
        minibatch_rng = torch.Generator().manual_seed(budget.seed)
        copy = (rollout_policy, rollout_generator) if generation.async_rollouts else (None, None)
        self.rollouts = Rollouts(collector, policy, generator, budget.seed, budget.num_iterations,
                                 generation.max_policy_lag, ranks, *copy,
                                 max_num_gen_batches=config.rollout.max_num_gen_batches
                                 if config.rollout.filter_groups else None,
                                 filter_truncated=config.prime.filter_truncated)
        self.learner = Learner(config.learning, config.rollout, team,
                               parallel_module if parallel_module is not None else team,
                               algorithm, optimizer, minibatch_rng, ranks, implicit_prm, config.prime,
                               {member.role: member.optimizer for member in members},
                               temperature=collector.sampling.temperature, roles=collector.roles,
                               voices=collector.role_models.voices, critic=collector.critic)
        self.scheduler = scheduler  # the lr schedule: steps with each iteration that updated the policy
        member_policies = {member.role: member.policy for member in members}
        self.reporter = Reporter(writer, ranks, policy.tokenizer, collector.roles, NUM_TEXT_SAMPLES,
                                 {slot: member_policies[role].tokenizer
                                  for slot, role in collector.role_models.members.items()})
        self.checkpointer = Checkpointer(run_dir, logs.keep_checkpoints, policy, optimizer, scheduler, self.rollouts,
                                         minibatch_rng, ranks, writer, self.run_flags, implicit_prm,
                                         logs.save_dtype or config.model.dtype,  # None: the training dtype
                                         members=self.members)
        self.progress = RunProgress()
        self.clock = time.perf_counter()  # when progress.seconds was last brought up to date
        self.stop_signal: str | None = None  # name of the signal that asked the run to stop
        self.saved_at_failure: Path | None = None  # the checkpoint written when an iteration failed

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    @property
    def history(self) -> list[dict[str, float]]:
        return self.progress.history

    @property
    def last_checkpoint(self) -> Path | None:
        return self.checkpointer.last_checkpoint

    @property
    def last_buffer(self) -> RolloutBuffer | None:
        return self.reporter.last_buffer

    def run(self, exit_after_stop: bool = False) -> list[dict[str, float]]:
        """Trains from ``iteration`` (0, or where ``restore`` left it) to ``num_iterations``;
        returns the evaluation history. Stops early, after saving, on ``STOP_SIGNALS``. Under ``val_only``:
        one evaluation, nothing trained or saved. ``exit_after_stop``: the caller exits once a stop has
        saved (the command line), so a stopped run leaves the stop signals ignored; otherwise their handlers
        are put back."""
        budget, logs = self.config.budget, self.config.logging
        bar = self.reporter.progress_bar(self.iteration, budget.num_iterations, self.algorithm.name)
        postfix: dict[str, str] = {}
        self.clock = time.perf_counter()  # the time before this call (start-up, a restore) is not training
        try:
            if budget.val_only:
                self.evaluate(self.iteration)
                return self.history
            with self.signals_stop_after_iteration(exit_after_stop):
                for iteration in bar:
                    self.train_iteration(iteration, postfix)
                    bar.set_postfix(postfix, refresh=False)
                    if self.stop_requested():
                        self.save()
                        return self.history
                    last = self.iteration == budget.num_iterations  # the final save below writes it
                    if logs.save_interval and self.iteration % logs.save_interval == 0 and not last:
                        self.save()
                if budget.eval_interval:
                    self.evaluate(budget.num_iterations)
                self.save()
        finally:
            bar.close()
            self.rollouts.close()
            if self.reporter.writer is not None:
                self.reporter.writer.flush()
        return self.history

    def close(self) -> None:
        """Closes the train and held-out envs (their tool sandboxes' worker processes stop)."""
        for env in (self.collector.env, *self.eval_envs.values()):
            env.close()

    def elapsed(self) -> float:
        """Training wall seconds so far (``progress.seconds``, brought up to now)."""
        now = time.perf_counter()
        self.progress.seconds += now - self.clock
        self.clock = now
        return self.progress.seconds

    def stop_requested(self) -> bool:
        """Whether a signal asked to stop, on any rank (all ranks must stop at the same iteration)."""
        if not self.ranks.distributed:
            return self.stop_signal is not None
        anywhere = distributed.all_reduce_sum([float(self.stop_signal is not None)])[0] > 0
        if anywhere and self.stop_signal is None:
            self.stop_signal = "a signal on another rank"
        return anywhere

    def train_iteration(self, iteration: int, postfix: dict[str, str]) -> None:
        """One iteration, in the order its data flows; each call returns what it produced, and the counters
        (``progress``) are brought up to date here. An exception before the update (evaluation, collection)
        first saves the iteration's start state; a failed sync saves the updated one (module docstring)."""
        progress, learner, budget = self.progress, self.learner, self.config.budget
        due = budget.eval_interval and iteration % budget.eval_interval == 0
        with self.start_saved_on_failure(iteration):
            if due and (iteration > 0 or budget.val_before_train):
                postfix["acc"] = f"{self.evaluate_once(iteration)['eval/accuracy']:.3f}"
            collected = self.rollouts.next(iteration, progress.version, progress.rollout_version)
        if collected.refreshed:
            progress.rollout_version = progress.version
        buffer, started = collected.buffer, time.perf_counter()
        scores = learner.score(buffer)  # reference log-probs, implicit-PRM token rewards, trainer log-probs
        targets, correction = learner.targets(buffer)  # advantages (and critic targets), rollout-corrected
        try:
            result = learner.train(buffer, targets, scores.gap, iteration, progress.nonfinite_steps,
                                   progress.nonfinite_in_a_row)
        except NonFiniteError as error:
            raise NonFiniteError(f"{error}. Last good checkpoint: {self.last_checkpoint or 'none written yet'}. Check "
                                 "the rewards and the learning rate (--lr, --max_grad_norm) before resuming from it"
                                 ) from None
        progress.nonfinite_steps += result.nonfinite_steps
        progress.nonfinite_in_a_row = result.nonfinite_in_a_row
        if result.optimizer_steps:  # the schedules advance with iterations that updated the policy
            for scheduler in (self.scheduler, *(member.scheduler for member in self.members)):
                scheduler.step()
        stats = (collected.stats | result.stats | scores.heldout | correction
                 | learner.update_implicit_prm_after(buffer, targets))
        stats |= {"train/nonfinite_steps": float(progress.nonfinite_steps), "histograms": targets.stats,
                  "time/update": time.perf_counter() - started, **learner.learning_rates()}
        progress.version += 1
        progress.iteration = iteration + 1  # the update is in: a checkpoint from here on holds it
        stats["time/sync"] = self.sync_generator(iteration)
        if iteration % self.config.logging.log_interval == 0:
            self.log(iteration, buffer, stats)
        postfix.update(bar_summary(stats, self.collector.roles))

    @contextlib.contextmanager
    def start_saved_on_failure(self, iteration: int) -> Iterator[None]:
        """An exception in the block, which must precede the update (weights and optimizer still those of the
        iteration's start), first saves the state at the block's start (one process: under torchrun the other
        ranks could not join a save), then propagates (``saved_at_failure``)."""
        start = self.snapshot() if not self.ranks.distributed else None
        try:
            yield
        except Exception:
            if start is not None:
                self.saved_at_failure = self.checkpointer.save(start)
                log.error("iteration %d failed before its update; saved the state at its start to %s", iteration,
                          self.saved_at_failure)
            raise

    def sync_generator(self, iteration: int) -> float:
        """The generator takes the updated weights; returns its seconds. A failure saves the updated state
        first (one process), then propagates."""
        try:
            return self.sync_engines()
        except Exception:
            if not self.ranks.distributed:
                self.saved_at_failure = self.save()
                log.error("iteration %d: the generator did not take the new weights; saved the updated state to %s",
                          iteration, self.saved_at_failure)
            raise

    def sync_engines(self) -> float:
        """The policy's generator and each member's take their model's current weights; returns the seconds."""
        return self.generator.sync(self.policy) + sum(member.generator.sync(member.policy) for member in self.members)

    @contextlib.contextmanager
    def signals_stop_after_iteration(self, exit_after_stop: bool = False) -> Iterator[None]:
        """``STOP_SIGNALS`` set ``stop_signal`` (the loop saves and returns after the current iteration). Once
        it is set, a second SIGINT (Ctrl-C twice: a person at the terminal) raises KeyboardInterrupt; any other
        signal of the three is ignored, logged once: GNU ``timeout`` signals the command and then its process
        group, and a scheduler may signal every process of a job, so a SIGTERM often comes twice, and a save
        under way must not be abandoned for it. With ``exit_after_stop`` a stopped run leaves the three ignored
        (its process is on its way to exit with the checkpoint written); otherwise the handlers before are put
        back. Only the main thread can install handlers: elsewhere signals keep their default behaviour."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        ignored_one = False

        def request_stop(signum: int, frame) -> None:
            nonlocal ignored_one
            name = signal.Signals(signum).name
            if self.stop_signal is None:
                self.stop_signal = name
                log.warning("%s received: finishing iteration %d, then saving a checkpoint and exiting (%s)", name,
                            self.progress.iteration, "Ctrl-C again stops at once without saving" if name == "SIGINT"
                            else "a repeated signal is ignored; SIGKILL stops at once without saving")
            elif name == self.stop_signal == "SIGINT":
                raise KeyboardInterrupt("second SIGINT: stopping without saving")
            elif not ignored_one:
                ignored_one = True
                log.warning("%s received while stopping for %s: ignored, the checkpoint is still written", name,
                            self.stop_signal)

        previous = {signum: signal.signal(signum, request_stop) for signum in STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_IGN if exit_after_stop and self.stop_signal else handler)

    def evaluate_once(self, iteration: int) -> dict[str, float]:
        """``evaluate``, unless the history already holds this iteration (a resume of a finished run's
        final checkpoint): then its logged values again, which the resumed writer's purge dropped."""
        if not (self.history and self.history[-1]["iteration"] == iteration):
            return self.evaluate(iteration)
        result = {key: value for key, value in self.history[-1].items() if key.startswith(("eval/", "time/"))}
        self.reporter.log_scalars(iteration, result)
        return result

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Held-out evaluation (``train.evaluation``), logged, added to the history, and the policy saved
        to ``<run>/best`` when it beats every earlier one."""
        self.rollouts.wait()  # the env reward models must not run in two threads at once
        with self.policy.gathered():
            result = evaluation.evaluate_sets(self.eval_envs, self.generator, self.collector.sampling,
                                              self.config.budget.eval_limit, self.ranks, self.collector.role_models,
                                              self.eval_verdict, self.eval_sampling)
        counts = self.rollouts.counts()
        best_before = max((h["eval/accuracy"] for h in self.history), default=-math.inf)
        # seconds: the training time the policy evaluated here took, every evaluation so far excluded
        self.progress.eval_seconds += result["time/eval"]
        seconds = self.elapsed() - self.progress.eval_seconds
        self.history.append({"iteration": iteration, **counts, "seconds": seconds, **result})
        new_best = result["eval/accuracy"] > best_before  # the same on every rank
        if self.config.logging.save_best and not self.config.budget.val_only and new_best:
            self.save_best(iteration, result["eval/accuracy"])
        limit = self.config.budget.eval_limit
        num_problems = {name: min(limit, len(env.problems)) for name, env in self.eval_envs.items()}
        self.reporter.log_evaluation(iteration, result, counts["env_steps"], num_problems)
        return result

    def log(self, iteration: int, buffer: RolloutBuffer, stats: dict[str, Any]) -> None:
        """The iteration's statistics (``Reporter.log_iteration``; env steps and generated tokens added over
        ranks)."""
        self.reporter.log_iteration(iteration, buffer, stats, self.rollouts.counts())

    def snapshot(self) -> Snapshot:
        """(JSON state, RNG states) of everything but weights and optimizers (``Checkpointer.snapshot``)."""
        self.elapsed()
        return self.checkpointer.snapshot(self.progress)

    def save(self) -> Path:
        """Writes checkpoint ``iter_<iteration>`` of the state now (``Checkpointer.save``)."""
        self.rollouts.wait()  # the rollout thread may use the RNGs: the snapshot follows it
        return self.checkpointer.save(self.snapshot())

    def save_best(self, iteration: int, accuracy: float) -> Path:
        """The policy alone to ``<run>/best`` (``Checkpointer.save_best``)."""
        return self.checkpointer.save_best(iteration, accuracy)

    def restore(self, saved: checkpoint_files.Checkpoint) -> None:
        """Continues from ``saved``: weights, optimizers, RNGs, collector and counters; the generation
        engines take the restored weights."""
        self.progress = self.checkpointer.restore(saved)
        self.sync_engines()  # the engines were built on the starting weights
        if self.rollouts.rollout_policy is not None:
            self.rollouts.refresh()
        log.info("resumed from %s: iteration %d, %d env steps", saved.path, self.iteration, self.collector.env_steps)
