"""The one training loop every algorithm shares:

    collect (train.collector) -> reference / implicit-PRM scores -> algorithm.advantages
    -> update epochs over minibatches -> generator.sync -> log -> eval (train.evaluation) -> checkpoint

With ``async_rollouts`` a background thread collects the next batch with a copy of the policy while
the current batch trains; the copy is refreshed so no batch lags more than ``max_policy_lag`` policy
versions, and ratios use the behaviour log-probs recorded at generation time.

Surviving faults:
- Checkpoints (``train.checkpoint``) every ``save_interval`` iterations and at the end hold the weights,
  optimizer and scheduler, RNG states, the collector's state (env, episode returns) and the counters;
  ``restore`` continues from one exactly (synchronous collection: the same parameters and logged values
  as a run never stopped).
- SIGINT/SIGTERM: the current iteration finishes, a checkpoint is written, ``run`` returns with
  ``stop_signal`` set. A second signal interrupts at once (KeyboardInterrupt).
- A non-finite loss or gradient norm skips that optimizer step (logged, counted in
  ``train/nonfinite_steps``); ``max_nonfinite_steps`` in a row raise ``NonFiniteError`` without saving,
  so the last checkpoint stays the last good one.
- An exception before the update (a reward model raising in evaluation or collection) writes a
  checkpoint of the state at the start of that iteration, then propagates (one process only: under
  torchrun the other ranks could not join the save, so the last checkpoint stays the one to resume).

Data parallelism (``train.distributed``): ``trainable`` is the policy wrapped in DDP; each rank trains on
its own rollout with losses normalised by the global minibatch totals; statistics, evaluation results
and the stop signal are reduced over ranks; rank 0 alone logs and writes checkpoints, which hold every
rank's collector state and RNGs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import signal
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from algorithms.base import Algorithm, roc_auc
from algorithms.losses import kl_k3
from algorithms.buffer import RolloutBuffer
from algorithms.registry import algorithm_spec
from train import checkpoint, distributed, evaluation
from train.collector import Collector, Tally
from train.distributed import Ranks
from models.generation import Generator
from models.policy import LanguagePolicy

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass(frozen=True)
class RunnerConfig:
    num_iterations: int
    num_mini_batch: int = 1
    ppo_epoch: int = 1
    gradient_cp_steps: int = 1
    max_grad_norm: float = 1.0  # 0: no clipping
    target_kl: float = 0.0  # 0: off
    eval_interval: int = 50  # 0: never
    eval_limit: int = 1000
    log_interval: int = 1
    save_interval: int = 0  # 0: only at the end
    keep_checkpoints: int = 0  # 0: keep all
    save_best: bool = True  # after an eval that beats every earlier one, write the policy to <run>/best
    max_nonfinite_steps: int = 3
    seed: int = 0
    async_rollouts: bool = False
    max_policy_lag: int = 1
    num_text_samples: int = 4


@dataclass
class Progress:
    """The runner's counters, saved with every checkpoint. ``iteration``: completed iterations (the next
    one to run); ``version``: optimizer updates so far (the policy version); ``rollout_version``: the
    version the asynchronous rollout copy holds; ``seconds``: wall seconds the run has spent in
    ``Runner.run`` so far, over every resume (start-up and model loading excluded), of which
    ``eval_seconds`` in evaluations; ``history``: the evaluation results so far."""

    iteration: int = 0
    version: int = 0
    rollout_version: int = 0
    nonfinite_steps: int = 0
    nonfinite_in_a_row: int = 0
    seconds: float = 0.0
    eval_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


class Runner:
    """Drives training; see the module docstring. ``eval_env`` is a vector env over held-out
    problems (group size 1); ``rollout_policy``/``rollout_generator`` are the copy used by
    asynchronous collection (required when ``config.async_rollouts``)."""

    def __init__(self, config: RunnerConfig, collector: Collector, eval_env, policy: LanguagePolicy,
                 generator: Generator, algorithm: Algorithm, optimizer: torch.optim.Optimizer, scheduler, writer,
                 run_dir: Path, implicit_prm=None, rollout_policy: LanguagePolicy | None = None,
                 rollout_generator: Generator | None = None, run_flags: dict[str, Any] | None = None,
                 ranks: Ranks = Ranks(), trainable: torch.nn.Module | None = None):
        if config.async_rollouts and (rollout_policy is None or rollout_generator is None):
            raise ValueError("async_rollouts needs rollout_policy and rollout_generator (a copy of the policy)")
        if algorithm.needs_process_rewards and implicit_prm is None:
            raise ValueError(f"{algorithm.name} needs an implicit PRM for its process rewards")
        self.config, self.collector, self.eval_env = config, collector, eval_env
        self.sampling = collector.sampling
        self.policy, self.generator, self.algorithm = policy, generator, algorithm
        self.spec = algorithm_spec(algorithm.name)
        self.optimizer, self.scheduler, self.writer, self.run_dir = optimizer, scheduler, writer, Path(run_dir)
        self.implicit_prm = implicit_prm
        self.ranks = ranks
        self.trainable = trainable if trainable is not None else policy  # DDP(policy) under torchrun
        self.rollout_policy, self.rollout_generator = rollout_policy, rollout_generator
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.progress = Progress()
        self.clock = time.perf_counter()  # when progress.seconds was last brought up to date
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if config.async_rollouts else None
        self.pending: concurrent.futures.Future | None = None
        self.pending_version = 0  # the rollout copy's version when the pending batch was started
        self.last_buffer: RolloutBuffer | None = None  # for the text panel of sampled solutions
        self.run_flags = run_flags or {}  # saved with every checkpoint
        self.last_checkpoint: Path | None = None
        self.last_saved: tuple[int, int] | None = None  # (iteration, evaluations) last_checkpoint holds
        self.stop_signal: str | None = None  # name of the signal that asked the run to stop

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    @property
    def history(self) -> list[dict[str, float]]:
        return self.progress.history

    # ---------------------------------------------------------------------------------------------
    # The loop
    # ---------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Trains from ``iteration`` (0, or where ``restore`` left it) to ``num_iterations``;
        returns the evaluation history. Stops early, after saving, on SIGINT/SIGTERM."""
        config = self.config
        progress = tqdm(range(self.iteration, config.num_iterations), initial=self.iteration,
                        total=config.num_iterations, desc=self.algorithm.name, dynamic_ncols=True,
                        disable=not self.ranks.is_main)
        postfix: dict[str, str] = {}
        self.clock = time.perf_counter()  # the time before this call (start-up, a restore) is not training
        try:
            with self.signals_stop_after_iteration():
                for iteration in progress:
                    self.train_iteration(iteration, postfix)
                    progress.set_postfix(postfix, refresh=False)
                    if self.stop_requested():
                        self.save()
                        return self.history
                    if config.save_interval and self.iteration % config.save_interval == 0:
                        self.save()
                if config.eval_interval:
                    self.evaluate(config.num_iterations)
                self.save()
        finally:
            progress.close()
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
            if self.writer is not None:
                self.writer.flush()
        return self.history

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
        """(Eval,) collect, update, sync, log. An exception before the update, when weights and
        optimizer are still those of the iteration's start, first saves that start state."""
        config = self.config
        # async: the env is busy in the other thread; several ranks: the others cannot join a save
        start = self.snapshot() if self.pool is None and not self.ranks.distributed else None
        try:
            if config.eval_interval and iteration % config.eval_interval == 0:
                postfix["acc"] = f"{self.evaluate(iteration)['eval/accuracy']:.3f}"
            buffer, stats = self.next_rollout(iteration)
        except Exception:
            if start is not None:
                path = self.save(start)
                log.error("iteration %d failed before its update; saved the state at its start to %s", iteration,
                          path)
            raise
        stats.update(self.update(buffer))
        self.progress.version += 1
        self.progress.iteration = iteration + 1  # the update is in: a checkpoint from here on holds it
        try:
            stats["time/sync"] = self.generator.sync(self.policy)
        except Exception:
            if not self.ranks.distributed:
                log.error("iteration %d: the generator did not take the new weights; saved the updated state to %s",
                          iteration, self.save())
            raise
        if iteration % config.log_interval == 0:
            self.log(iteration, buffer, stats)
        postfix.update(reward=f"{stats['train/reward']:.3f}", train_acc=f"{stats['train/accuracy']:.3f}")

    @contextlib.contextmanager
    def signals_stop_after_iteration(self) -> Iterator[None]:
        """SIGINT/SIGTERM set ``stop_signal`` (the loop saves and returns after the current iteration);
        a second one raises KeyboardInterrupt. Only the main thread can install handlers: elsewhere
        signals keep their default behaviour."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame) -> None:
            if self.stop_signal is not None:
                raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without saving")
            self.stop_signal = signal.Signals(signum).name
            log.warning("%s received: finishing iteration %d, then saving a checkpoint and exiting (send it again "
                        "to stop at once without saving)", self.stop_signal, self.progress.iteration)

        previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def next_rollout(self, iteration: int) -> tuple[RolloutBuffer, dict[str, float]]:
        """This iteration's batch and its statistics: collected now, or (async) the one collected in the
        background, after starting the next one with a policy copy at most ``max_policy_lag`` versions old."""
        seed = self.config.seed * 1_000_003 + iteration * 1_009
        if self.pool is None:
            with self.policy.gathered():
                buffer, tally = self.collector.collect(self.policy, self.generator, seed)
            return buffer, self.rollout_statistics(tally)
        progress = self.progress
        if self.pending is not None:
            (buffer, tally), version = self.pending.result(), self.pending_version
        else:
            buffer, tally = self.collector.collect(self.rollout_policy, self.rollout_generator, seed)
            version = progress.rollout_version
        stats = {**self.rollout_statistics(tally), "train/policy_lag": float(progress.version - version)}
        # The next batch is trained on after this iteration's update, at version + 1.
        if progress.version + 1 - progress.rollout_version > self.config.max_policy_lag:
            self.refresh_rollout_policy()
            progress.rollout_version = progress.version
        self.pending_version = progress.rollout_version
        self.pending = None
        if iteration + 1 < self.config.num_iterations:  # no batch beyond the budget: every env step taken is trained on
            self.pending = self.pool.submit(self.collector.collect, self.rollout_policy, self.rollout_generator,
                                            seed + 1)
        return buffer, stats

    def refresh_rollout_policy(self) -> None:
        """The background rollouts' copy takes the policy's current weights (every rank together)."""
        self.rollout_policy.load_state_dict(self.policy.whole_state_dict())
        self.rollout_generator.sync(self.rollout_policy)

    def rollout_statistics(self, tally: Tally) -> dict[str, float]:
        """The rollout's logged statistics: means of the collector's sums and counts, added over ranks
        first (times: the slowest rank's)."""
        if self.ranks.distributed:
            tally = self.reduced_tally(tally)
        step_reward = tally.mean("train/step_reward")
        # train/reward/<source> (the reward model's parts), train/<role>/<metric> and train/<role>/reward/<source>
        # (multi-agent envs)
        means = {key: tally.mean(key) for key in tally.sums if key.startswith("train/") and key.count("/") >= 2}
        return {
            "time/generate": tally.seconds["generate"], "time/reward": tally.seconds["reward"],
            "perf/tokens_per_second": tally.sums["tokens"] / max(tally.seconds["generate"], 1e-9),
            "train/step_reward": step_reward,
            # mean return of the episodes that ended in this rollout (every episode, when episodic)
            "train/reward": tally.mean("train/reward") if tally.counts["train/reward"] else step_reward,
            "train/accuracy": tally.mean("train/accuracy"),
            "train/episodes": float(tally.counts["train/reward"]),
            "train/action_tokens": tally.mean("train/action_tokens"),
            **means,
        }

    def reduced_tally(self, tally: Tally) -> Tally:
        """Sums and counts added over ranks, seconds the slowest rank's."""
        total = Tally()
        sums, counts = distributed.sum_by_key(tally.sums, tally.counts)
        total.sums.update(sums)
        total.counts.update({key: int(count) for key, count in counts.items()})
        gathered = distributed.all_gather_objects(dict(tally.seconds))
        for name in set().union(*gathered):
            total.seconds[name] = max(rank_seconds.get(name, 0.0) for rank_seconds in gathered)
        return total

    # ---------------------------------------------------------------------------------------------
    # Update
    # ---------------------------------------------------------------------------------------------

    def score_rollout(self, buffer: RolloutBuffer) -> dict[str, float]:
        """Reference log-probs (KL) and implicit-PRM token rewards of every live action; returns the
        implicit PRM's held-out statistics (``implicit_prm_heldout``)."""
        if not (self.algorithm.needs_reference or self.algorithm.needs_process_rewards):
            return {}
        rows = buffer.rows()
        actions = (rows.action_ids, rows.action_lengths)
        with torch.no_grad():
            if self.algorithm.needs_reference:
                ref = self.policy.ref_log_probs(rows.prompts, actions, self.sampling.temperature)
                buffer.ref_logprobs = buffer.scatter_tokens(rows.index, ref)
            if self.algorithm.needs_process_rewards:
                process = self.implicit_prm.token_rewards(rows.prompts, actions)
                buffer.token_rewards = buffer.scatter_tokens(rows.index, process)
                return self.implicit_prm_heldout(buffer, rows.index, process.sum(-1))
        return {}

    def implicit_prm_heldout(self, buffer: RolloutBuffer, index: torch.Tensor,
                             totals: torch.Tensor) -> dict[str, float]:
        """PRIME: how well the implicit PRM predicts the outcomes of a batch it has not trained on yet (it
        learns from this batch only after the update): ROC-AUC and accuracy of its outcome score, the sum
        of an action's process rewards (its sign and order are those of beta * sum log-ratio whatever
        the granularity and normalisation), against whether the episode's answer verified. Every rank's
        rows count; NaN while the batch holds one class only."""
        labels, totals = buffer.episode_correct_at(index).cpu(), totals.float().cpu()
        if self.ranks.distributed:
            gathered = distributed.all_gather_objects((totals, labels))
            totals, labels = (torch.cat(parts) for parts in zip(*gathered))
        both_classes = 0 < int(labels.sum()) < len(labels)
        return {"implicit_prm/heldout_auc": roc_auc(totals, labels) if both_classes else math.nan,
                "implicit_prm/heldout_accuracy": float(((totals > 0).float() == labels).float().mean())}

    def update(self, buffer: RolloutBuffer) -> dict[str, Any]:
        """Advantages, then ``ppo_epoch`` epochs of minibatch steps; returns statistics."""
        config, algorithm = self.config, self.algorithm
        started = time.perf_counter()
        with self.policy.gathered():
            heldout = self.score_rollout(buffer)
        targets = algorithm.advantages(buffer)
        sums, weights = defaultdict(float), defaultdict(float)
        grad_norms, steps, stopped_early = [], 0, False
        for _ in range(config.ppo_epoch):
            for minibatch in buffer.minibatches(targets, config.num_mini_batch, config.gradient_cp_steps, self.shuffle,
                                                skip=algorithm.skippable_rows, reduce_totals=self.reduce_totals):
                minibatch_kl, stepped = self.minibatch_step(minibatch, sums, weights, grad_norms)
                steps += stepped
                if config.target_kl and minibatch_kl > config.target_kl:
                    stopped_early = True
                    break
            if stopped_early:
                break
        if steps:  # the schedule advances with iterations that updated the policy
            self.scheduler.step()
        if self.ranks.distributed:
            sums, weights = distributed.sum_by_key(sums, weights)
        stats: dict[str, Any] = {f"loss/{key}": sums[key] / weights[key] for key in sums} | heldout
        trained = buffer.trained(targets)
        if self.implicit_prm is not None:
            stats["loss/implicit_prm"] = self.update_implicit_prm(buffer, trained)
        stats.update({
            "grad/norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "train/optimizer_steps": float(steps), "train/early_stopped": float(stopped_early),
            "train/nonfinite_steps": float(self.progress.nonfinite_steps),
            "train/trained_samples": float(distributed.all_reduce_sum([float(trained.sum())])[0]),
            "time/update": time.perf_counter() - started,
            "histograms": targets.stats,
        })
        for group in self.optimizer.param_groups:
            stats[f"lr/{group.get('name', 'group')}"] = group["lr"]
        return stats

    @property
    def reduce_totals(self):
        """The minibatch totals over every rank (``RolloutBuffer.minibatches``), or None in one process."""
        return distributed.all_reduce_sum if self.ranks.distributed else None

    def minibatch_step(self, minibatch, sums: dict, weights: dict, grad_norms: list) -> tuple[float, bool]:
        """Accumulates the micro-batches' gradients, clips, steps; returns (the minibatch's approx KL,
        whether the optimizer stepped: not when the loss or the gradient norm is non-finite).

        Several ranks: DDP and FSDP2 average the gradients over ranks, so each loss (normalised by the
        global totals) is scaled by the world size. Every rank runs as many forward and backward passes as
        the rank with the most micro-batches (both need them matched), the missing ones zero-gradient
        passes (``idle_backward``)."""
        algorithm, temperature = self.algorithm, self.sampling.temperature
        passes = len(minibatch)
        if self.ranks.distributed:
            passes = int(distributed.all_reduce_max([passes])[0])
            if passes == 0:
                return 0.0, False  # every rank skipped every row: no gradient anywhere, no step (as in one process)
        self.optimizer.zero_grad(set_to_none=True)
        kl_sum, kl_weight, finite_loss = 0.0, 0, True
        for k in range(passes):
            with self.gradient_sync(last=k == passes - 1):
                if k >= len(minibatch):
                    self.idle_backward()
                    continue
                batch = minibatch[k]
                scores = self.trainable(batch.prompts, (batch.action_ids, batch.action_lengths), temperature,
                                        with_entropy=True, with_values=self.spec.critic is not None,
                                        adapters=self.row_adapters(batch), critic_prompts=batch.critic_prompts,
                                        value_heads=self.row_value_heads(batch))
                loss, micro_stats = algorithm.loss(scores, batch)
                finite_loss &= bool(torch.isfinite(loss))
                (loss * self.ranks.world_size).backward()
            for key, value in micro_stats.items():
                sums[key] += float(value) * batch.num_samples
                weights[key] += batch.num_samples
            self.add_role_stats(scores, batch, sums, weights)
            kl_sum += float(micro_stats["approx_kl"]) * batch.num_samples
            kl_weight += batch.num_samples
        if self.ranks.distributed:
            kl_sum, kl_weight, nonfinite = distributed.all_reduce_sum([kl_sum, kl_weight, float(not finite_loss)])
            finite_loss = nonfinite == 0
        parameters = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        max_norm = self.config.max_grad_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)  # FSDP2: sharded
        kl = kl_sum / max(kl_weight, 1)
        if not (finite_loss and math.isfinite(grad_norm)):
            self.skip_nonfinite_step("loss" if not finite_loss else f"gradient norm ({grad_norm})")
            return kl, False
        self.progress.nonfinite_in_a_row = 0
        grad_norms.append(grad_norm)
        self.optimizer.step()
        return kl, True

    def add_role_stats(self, scores, batch, sums: dict, weights: dict) -> None:
        """Each role's mean token entropy and approx KL to the behaviour policy (multi-agent envs), added to
        ``sums``/``weights`` as ``<role>/entropy`` and ``<role>/approx_kl`` (logged under ``loss/``)."""
        roles = self.collector.roles
        if not roles or scores.entropy is None:
            return
        mask = batch.token_mask.to(scores.logprobs.dtype)
        entropy = ((scores.entropy * mask).sum(-1) / mask.sum(-1).clamp(min=1)).detach()  # [B]
        kl = kl_k3(batch.old_logprobs.sum(-1), scores.logprobs.detach().sum(-1))  # [B]
        for a, role in enumerate(roles):
            rows = batch.agents == a
            if rows.any():
                for name, values in (("entropy", entropy), ("approx_kl", kl)):
                    sums[f"{role}/{name}"] += float(values[rows].sum())
                    weights[f"{role}/{name}"] += int(rows.sum())

    def row_adapters(self, batch) -> list[str] | None:
        """The role adapter each row of ``batch`` acts with (one adapter per role), else None."""
        adapters = self.collector.voices.adapters
        if not adapters:
            return None
        return [adapters[agent] for agent in batch.agents.tolist()]

    def row_value_heads(self, batch) -> list[int] | None:
        """The value head each row of ``batch`` is read from (per-role critics: its agent's), else None."""
        if self.collector.critic != "per_role":
            return None
        return batch.agents.tolist()

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP reduces gradients at the minibatch's last backward only (no_sync before it); FSDP2 reduces
        at every backward, keeping only its shard of the gradient between micro-batches."""
        if not self.ranks.distributed or last or self.policy.sharded:
            return contextlib.nullcontext()
        return self.trainable.no_sync()

    def idle_backward(self) -> None:
        """A backward of zero loss through DDP or FSDP2 on one placeholder token: this rank's part of the
        gradient reduction when it has fewer micro-batches than another rank (no gradient of its own)."""
        pad = self.policy.tokenizer.pad_token_id
        scores = self.trainable([[pad]], [[pad]], self.sampling.temperature, with_entropy=True,
                                with_values=self.spec.critic is not None)
        zero = scores.logprobs.sum() * 0.0
        if scores.values is not None:
            zero = zero + scores.values.sum() * 0.0
        zero.backward()

    def skip_nonfinite_step(self, what: str) -> None:
        """Drops the step's gradients; ``max_nonfinite_steps`` in a row stop the run (without saving:
        the last checkpoint stays the last good state)."""
        self.optimizer.zero_grad(set_to_none=True)
        progress = self.progress
        progress.nonfinite_steps += 1
        progress.nonfinite_in_a_row += 1
        log.warning("iteration %d: non-finite %s; optimizer step skipped (%d in a row, %d in the run)",
                    progress.iteration, what, progress.nonfinite_in_a_row, progress.nonfinite_steps)
        if progress.nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteError(
                f"iteration {progress.iteration}: {progress.nonfinite_in_a_row} optimizer steps in a row had a non-finite "
                f"{what} (--max_nonfinite_steps={self.config.max_nonfinite_steps}); stopped without saving. Last good "
                f"checkpoint: {self.last_checkpoint or 'none written yet'}. Check the rewards and the learning rate "
                "(--lr, --max_grad_norm) before resuming from it")

    def update_implicit_prm(self, buffer: RolloutBuffer, trained: torch.Tensor) -> float:
        """PRIME: one step of the implicit PRM on the actions the policy trained on (``trained`` [T, N, A]),
        labelled by whether their episode's answer verified."""
        rows = buffer.rows(trained)
        total = int(distributed.all_reduce_sum([rows.num_samples])[0])  # over every rank
        if total == 0:
            return math.nan
        labels = buffer.episode_correct_at(rows.index)
        loss = self.implicit_prm.update(rows.prompts, (rows.action_ids, rows.action_lengths), labels, total,
                                        distributed.sum_in_place if self.ranks.distributed else None)
        return float(distributed.all_reduce_sum([loss])[0])

    # ---------------------------------------------------------------------------------------------
    # Evaluation, logging, checkpoints
    # ---------------------------------------------------------------------------------------------

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Held-out evaluation (``train.evaluation``), logged, added to the history, and the policy saved
        to ``<run>/best`` when it beats every earlier one."""
        if self.pending is not None:  # the env reward models must not run in two threads at once
            self.pending.result()
        with self.policy.gathered():
            result = evaluation.evaluate(self.eval_env, self.generator, self.sampling, self.config.eval_limit,
                                         self.ranks, self.collector.voices)
        env_steps = self.env_steps()
        best_before = max((h["eval/accuracy"] for h in self.history), default=-math.inf)
        # seconds: the training time the policy evaluated here took, every evaluation so far excluded
        self.progress.eval_seconds += result["time/eval"]
        seconds = self.elapsed() - self.progress.eval_seconds
        self.history.append({"iteration": iteration, "env_steps": env_steps, "seconds": seconds, **result})
        if self.config.save_best and result["eval/accuracy"] > best_before:  # the same on every rank
            self.save_best(iteration, result["eval/accuracy"])
        if not self.ranks.is_main:
            return result
        for key, value in result.items():
            self.writer.add_scalar(key, value, iteration)
        log.info("eval iteration %d (%d env steps): greedy accuracy %.3f on %d problems, mean length %.1f tokens%s",
                 iteration, env_steps, result["eval/accuracy"], min(self.config.eval_limit, len(self.eval_env.problems)),
                 result["eval/mean_length"],
                 f", PRM score {result['eval/prm_score']:.3f}" if "eval/prm_score" in result else "")
        if self.last_buffer is not None:
            self.writer.add_text("samples", self.samples_markdown(self.last_buffer), iteration)
        return result

    def env_steps(self) -> int:
        """Env steps taken so far by every rank together."""
        return int(distributed.all_reduce_sum([self.collector.env_steps])[0])

    def log(self, iteration: int, buffer: RolloutBuffer, stats: dict[str, Any]) -> None:
        """Rank 0's TensorBoard scalars and histograms (its own rollout's, for the histograms and samples)."""
        stats_env_steps = self.env_steps()
        if not self.ranks.is_main:
            return
        self.last_buffer = buffer
        histograms = stats.pop("histograms", {})
        for key, values in histograms.items():
            values = values.detach().float().cpu()
            if values.numel() > 1:
                self.writer.add_histogram(f"hist/{key}", values.numpy(), iteration)
            if values.numel():
                self.writer.add_scalar(f"train/{key}_mean", float(values.mean()), iteration)
        for key, value in stats.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, iteration)
        self.writer.add_scalar("train/env_steps", stats_env_steps, iteration)

    def samples_markdown(self, buffer: RolloutBuffer) -> str:
        """A few sampled episodes of the last rollout: each action with its reward (and, in a multi-agent
        env, the role that took it: the whole transcript)."""
        tokenizer, roles = self.policy.tokenizer, self.collector.roles
        lines = []
        for env_index in range(min(self.config.num_text_samples, buffer.shape[1])):
            acted = buffer.live[:, env_index].nonzero().tolist()  # [(step, agent)] in turn order
            if not acted:
                continue
            first = int(buffer.slot_index(acted[0][0], torch.tensor(env_index), torch.tensor(acted[0][1])))
            prompt = tokenizer.decode(buffer.prompt_ids[first], skip_special_tokens=True)
            lines.append(f"**env {env_index}** (group {int(buffer.group_ids[acted[0][0], env_index, acted[0][1]])})\n\n"
                         f"    {prompt.strip()}\n")
            for t, agent in acted:
                slot = int(buffer.slot_index(t, torch.tensor(env_index), torch.tensor(agent)))
                reward = float(buffer.rewards[t, env_index, agent])
                verdict = buffer.correct[t, env_index, agent]
                end = "" if torch.isnan(verdict) else f" (episode end, correct={bool(verdict)})"
                text = (buffer.texts[slot] or "").strip().replace("\n", " ")
                who = f" {roles[agent]}" if roles else ""
                lines.append(f"- step {t}{who}: `{text}` → reward {reward:.3f}{end}")
            lines.append("")
        return "\n".join(lines)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(JSON state, RNG states) of everything but weights and optimizers: the counters and the
        collector's state (env, episode returns, env steps); python/numpy/torch RNGs and the minibatch
        shuffle. The JSON keeps one flat layout, so checkpoints of earlier versions resume."""
        self.elapsed()
        return ({**asdict(self.progress), **self.collector.get_state()},
                {**checkpoint.rng_state(), "shuffle": self.shuffle.get_state()})

    def save(self, snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None) -> Path:
        """Writes checkpoint ``iter_<iteration>`` of ``snapshot`` (default: now) with the current weights
        and optimizers (``train.checkpoint.save``: atomic), then prunes to ``keep_checkpoints``."""
        if self.pending is not None:  # the rollout thread steps the env: let it finish first
            concurrent.futures.wait([self.pending])
        state, rng = snapshot or self.snapshot()
        checkpoints_dir = self.run_dir / "checkpoints"
        saved = (state["iteration"], len(state["history"]))
        if self.last_checkpoint == checkpoints_dir / f"{checkpoint.PREFIX}{saved[0]}" and self.last_saved == saved:
            return self.last_checkpoint  # nothing trained or evaluated since (e.g. a stop right after a periodic save)
        if self.ranks.distributed:  # every rank's envs and RNGs in the one checkpoint
            gathered = distributed.all_gather_objects((state, rng))
            state = {**state, **self.collector.merge_states([rank_state for rank_state, _ in gathered]),
                     "world_size": self.ranks.world_size}
            rng = {**rng, "rank_rngs": [rank_rng for _, rank_rng in gathered]}
        if self.ranks.is_main:
            write_out(self.writer)  # every point logged before this checkpoint is on disk when it exists
        optimizers = {"scheduler": self.scheduler.state_dict()}
        if self.implicit_prm is not None:
            optimizers["implicit_prm"] = self.implicit_prm.optimizer.state_dict()
        path = checkpoint.save(checkpoints_dir, state["iteration"], policy=self.policy, optimizer=self.optimizer,
                               optimizers=optimizers, rng=rng, state=state, flags=self.run_flags,
                               implicit_prm=self.implicit_prm.model if self.implicit_prm is not None else None,
                               ranks=self.ranks)
        self.last_checkpoint, self.last_saved = path, saved
        if self.ranks.is_main:
            log.info("saved checkpoint %s", path)
            if self.config.keep_checkpoints:
                checkpoint.prune(checkpoints_dir, self.config.keep_checkpoints)
        return path

    def save_best(self, iteration: int, accuracy: float) -> Path:
        """The policy alone (``LanguagePolicy.save``: ``from_pretrained`` and ``--model_name_or_path`` load
        it) to ``<run>/best``, atomically replacing the previous best: RL's held-out accuracy swings, and
        the last iteration is rarely the best one. Every rank calls it (a sharded policy gathers its weights)."""
        tensors = self.policy.full_tensors()
        path = checkpoint.atomic_write(self.run_dir / "best", iteration, lambda out: self.policy.save(out, tensors),
                                       ranks=self.ranks)
        if not self.ranks.is_main:
            return path
        log.info("new best held-out accuracy %.3f at iteration %d: policy saved to %s", accuracy, iteration, path)
        return path

    def restore(self, saved: checkpoint.Checkpoint) -> None:
        """Continues from ``saved``: the policy's trainable weights and optimizer, scheduler, implicit PRM,
        RNGs, collector and counters (every rank: the train state is read as each rank holds it)."""
        checkpoint.load_train_state(saved, self.policy, self.optimizer)
        optimizers = saved.optimizers(self.policy.device)
        if ("implicit_prm" in optimizers) != (self.implicit_prm is not None):
            raise checkpoint.CheckpointError(
                f"{saved.path} was trained {'with' if 'implicit_prm' in optimizers else 'without'} an implicit PRM, "
                f"this run {'trains one' if self.implicit_prm is not None else 'trains none'}: resume with the "
                "algorithm it was trained with")
        self.scheduler.load_state_dict(optimizers["scheduler"])
        # Go on at this run's scheduled lr for the step reached: the optimizer saved the lr of the checkpoint's
        # budget, and a resume may change --num_env_steps (a finished run's linear decay left it at 0).
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                          self.scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(self.scheduler.last_epoch)
        if self.implicit_prm is not None:
            saved.load_implicit_prm(self.implicit_prm.model)
            self.implicit_prm.optimizer.load_state_dict(optimizers["implicit_prm"])
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
        # a checkpoint written before a counter existed leaves that counter at its default
        self.progress = Progress(**{f.name: state[f.name] for f in fields(Progress) if f.name in state})
        checkpoint.set_rng_state(rng)
        self.shuffle.set_state(rng["shuffle"])
        self.generator.sync(self.policy)  # the engines were built on the starting weights
        if self.rollout_policy is not None:
            self.refresh_rollout_policy()
        self.last_checkpoint, self.last_saved = saved.path, (self.iteration, len(self.history))
        log.info("resumed from %s: iteration %d, %d env steps", saved.path, self.iteration, self.collector.env_steps)


def write_out(writer) -> None:
    """Every event logged to ``writer`` (a tensorboardX SummaryWriter) so far is in its file when this returns.

    tensorboardX's ``flush()`` flushes the file but not the events still queued for its writer thread,
    so a kill just after a checkpoint could lose the points logged just before it. Stopping the thread
    drains the queue in order; ``reopen`` starts a new one on the same queue and file (tensorboardX 2.x
    internals; tests/test_checkpoint.py reads the file back to check)."""
    events = writer.file_writer.event_writer
    events._worker.stop()
    events._closed = True
    events.reopen()
    events.flush()
