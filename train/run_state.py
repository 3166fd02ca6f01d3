"""The run's state in and out of checkpoints (their files on disk: ``train.checkpoint_files``): the runner's
counters, a snapshot of everything but weights and optimizers, saving it with them, the best policy so far,
and restoring all of it.

A checkpoint ``iter_N`` holds the state after N iterations; under asynchronous rollouts it holds the env
before the batch still in flight (``Rollouts.handed_over_state``), which a resume collects again. Several
ranks: rank 0 writes one checkpoint holding every rank's envs and RNGs; each rank restores its share.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch

from models.loading import DTYPES
from models.policy import LanguagePolicy
from train import checkpoint_files, distributed
from train.distributed import Ranks
from train.members import Member
from train.reporting import write_out
from train.rollouts import Rollouts

log = logging.getLogger(__name__)

Snapshot = tuple[dict[str, Any], dict[str, Any]]
"""(JSON state, RNG states) of everything but weights and optimizers."""


@dataclass
class RunProgress:
    """The runner's counters, saved with every checkpoint; only the runner changes them, from what the
    parts it calls return. ``iteration``: completed iterations (the next one to run); ``version``: updates
    so far (the policy version); ``rollout_version``: the version the asynchronous rollout copy holds;
    ``nonfinite_steps``: optimizer steps skipped for a non-finite loss or gradient norm, the latest
    ``nonfinite_in_a_row`` of them in a row; ``seconds``: wall seconds the run has spent in ``Runner.run`` so
    far, over every resume (start-up and model loading excluded), of which ``eval_seconds`` in evaluations;
    ``history``: the evaluation results so far."""

    iteration: int = 0
    version: int = 0
    rollout_version: int = 0
    nonfinite_steps: int = 0
    nonfinite_in_a_row: int = 0
    seconds: float = 0.0
    eval_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


class Checkpointer:
    """Writes and reads ``<run_dir>/checkpoints`` (keeping the newest ``keep_checkpoints``; 0: all) and
    ``<run_dir>/best`` (weights in ``save_dtype``). ``writer``: rank 0's TensorBoard writer (flushed before
    each checkpoint); ``members``: the roles on base models of their own, each saved and restored with its
    optimizer and scheduler as the policy is (``<run>/best`` holds the policy alone)."""

    def __init__(self, run_dir: Path, keep_checkpoints: int, policy: LanguagePolicy, optimizer: torch.optim.Optimizer,
                 scheduler, rollouts: Rollouts, minibatch_rng: torch.Generator, ranks: Ranks, writer,
                 run_flags: dict[str, Any], implicit_prm=None, save_dtype: str = "float32",
                 members: Sequence[Member] = ()):
        self.run_dir, self.keep_checkpoints, self.members = Path(run_dir), keep_checkpoints, tuple(members)
        self.policy, self.optimizer, self.scheduler, self.implicit_prm = policy, optimizer, scheduler, implicit_prm
        self.rollouts, self.collector, self.minibatch_rng = rollouts, rollouts.collector, minibatch_rng
        self.ranks, self.writer, self.run_flags = ranks, writer, run_flags
        self.save_dtype = DTYPES[save_dtype]
        self.last_checkpoint: Path | None = None
        self.last_saved: tuple[int, int] | None = None  # (iteration, evaluations) last_checkpoint holds

    def snapshot(self, progress: RunProgress) -> Snapshot:
        """The counters and the collector's handed-over state (env, episode returns, env steps); python, numpy
        and torch RNGs and ``minibatch_rng`` (saved as "shuffle"). The JSON keeps one flat layout, so
        checkpoints of earlier versions resume."""
        return ({**asdict(progress), **self.rollouts.handed_over_state()},
                {**checkpoint_files.rng_state(), "shuffle": self.minibatch_rng.get_state()})

    def save(self, snapshot: Snapshot) -> Path:
        """Writes checkpoint ``iter_<iteration>`` of ``snapshot`` with the current weights and optimizers
        (``train.checkpoint_files.save``: atomic), then prunes to ``keep_checkpoints``."""
        self.rollouts.wait()  # the rollout thread may use the RNGs and the reward models: let it finish first
        state, rng = snapshot
        checkpoints_dir = self.run_dir / "checkpoints"
        saved = (state["iteration"], len(state["history"]))
        if (self.last_checkpoint == checkpoints_dir / f"{checkpoint_files.PREFIX}{saved[0]}"
                and self.last_saved == saved):
            return self.last_checkpoint  # nothing trained or evaluated since (e.g. a stop right after a periodic save)
        if self.ranks.distributed:  # every rank's envs and RNGs in the one checkpoint
            gathered = distributed.all_gather_objects((state, rng))
            state = {**state, **self.collector.merge_states([rank_state for rank_state, _ in gathered]),
                     "world_size": self.ranks.world_size}
            rng = {**rng, "rank_rngs": [rank_rng for _, rank_rng in gathered]}
        if self.ranks.is_main:
            write_out(self.writer)  # every point logged before this checkpoint is on disk when it exists
        optimizers = {"scheduler": self.scheduler.state_dict(),
                      "members": {member.role: member.scheduler.state_dict() for member in self.members}}
        if self.implicit_prm is not None:
            optimizers["implicit_prm"] = self.implicit_prm.optimizer.state_dict()
        path = checkpoint_files.save(checkpoints_dir, state["iteration"], policy=self.policy, optimizer=self.optimizer,
                               optimizers=optimizers, rng=rng, state=state, flags=self.run_flags,
                               implicit_prm=self.implicit_prm.model if self.implicit_prm is not None else None,
                               ranks=self.ranks,
                               members={member.role: (member.policy, member.optimizer) for member in self.members})
        self.last_checkpoint, self.last_saved = path, saved
        if self.ranks.is_main:
            log.info("saved checkpoint %s", path)
            if self.keep_checkpoints:
                checkpoint_files.prune(checkpoints_dir, self.keep_checkpoints)
        return path

    def save_best(self, iteration: int, accuracy: float) -> Path:
        """The policy alone (``LanguagePolicy.save``: ``from_pretrained`` and ``--model_name_or_path`` load
        it) to ``<run>/best``, atomically replacing the previous best: RL's held-out accuracy swings, and
        the last iteration is rarely the best one. Every rank calls it (a sharded policy gathers its weights)."""
        tensors = self.policy.full_tensors()
        path = checkpoint_files.atomic_write(self.run_dir / "best", iteration,
                                       lambda out: self.policy.save(out, tensors, self.save_dtype), ranks=self.ranks,
                                       needed_bytes=checkpoint_files.export_bytes(tensors, self.save_dtype))
        if self.ranks.is_main:
            log.info("new best held-out accuracy %.3f at iteration %d: policy saved to %s", accuracy, iteration, path)
        return path

    def restore(self, saved: checkpoint_files.Checkpoint) -> RunProgress:
        """Loads ``saved``: the policy's trainable weights and optimizer, scheduler, implicit PRM, RNGs and
        collector (every rank: the train state is read as each rank holds it); returns its counters."""
        checkpoint_files.load_train_state(saved, self.policy, self.optimizer)
        for member in self.members:
            checkpoint_files.load_train_state(saved, member.policy, member.optimizer, member.role)
        self.restore_optimizers(saved)
        state, rng = saved.state, saved.rng()
        saved_ranks = state.get("world_size", 1)
        if saved_ranks > 1 or self.ranks.distributed:  # the checkpoint holds every env: this rank takes its own
            state = {**state, **self.collector.split_state(state, self.ranks.rank)}
            # the same ranks continue their own RNGs; at another world size every rank starts from rank 0's
            rng = rng["rank_rngs"][self.ranks.rank] if saved_ranks == self.ranks.world_size > 1 else rng
            if saved_ranks != self.ranks.world_size:
                log.warning("resuming a checkpoint of %d rank(s) on %d: the envs and their episodes are split anew",
                            saved_ranks, self.ranks.world_size)
        self.collector.set_state(state)
        checkpoint_files.set_rng_state(rng)
        self.minibatch_rng.set_state(rng["shuffle"])
        # a checkpoint written before a counter existed leaves that counter at its default
        progress = RunProgress(**{f.name: state[f.name] for f in fields(RunProgress) if f.name in state})
        self.last_checkpoint, self.last_saved = saved.path, (progress.iteration, len(progress.history))
        return progress

    def restore_optimizers(self, saved: checkpoint_files.Checkpoint) -> None:
        """The schedulers (the policy's, each member's), the lr each schedules for this run, and the implicit PRM
        with its optimizer."""
        optimizers = saved.optimizers(self.policy.device)
        saved_members, members = set(optimizers.get("members", {})), {member.role for member in self.members}
        if saved_members != members:
            raise checkpoint_files.CheckpointError(
                f"{saved.path} was trained with roles {sorted(saved_members) or 'none'} on base models of their own, "
                f"this run has {sorted(members) or 'none'}: resume with the --role_base_model flags it was "
                "trained with")
        if ("implicit_prm" in optimizers) != (self.implicit_prm is not None):
            raise checkpoint_files.CheckpointError(
                f"{saved.path} was trained {'with' if 'implicit_prm' in optimizers else 'without'} an implicit PRM, "
                f"this run {'trains one' if self.implicit_prm is not None else 'trains none'}: resume with the "
                "algorithm it was trained with")
        restore_schedule(self.optimizer, self.scheduler, optimizers["scheduler"])
        for member in self.members:
            restore_schedule(member.optimizer, member.scheduler, optimizers["members"][member.role])
        if self.implicit_prm is not None:
            saved.load_implicit_prm(self.implicit_prm.model)
            self.implicit_prm.optimizer.load_state_dict(optimizers["implicit_prm"])


def restore_schedule(optimizer: torch.optim.Optimizer, scheduler, state: dict[str, Any]) -> None:
    """``scheduler`` from its saved ``state``, and ``optimizer`` at this run's scheduled lr for the step reached:
    the optimizer saved the lr of the checkpoint's budget, and a resume may change --num_env_steps (a finished
    run's linear decay left it at 0)."""
    scheduler.load_state_dict(state)
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
