"""The update of one batch: reference and implicit-PRM scores, the algorithm's advantages, then epochs of
minibatches whose micro-batches accumulate gradients, clipped, stepped; a non-finite loss or gradient
norm skips its step (``max_nonfinite_steps`` in a row raise ``NonFiniteError``). PRIME's implicit PRM
then learns from the actions the policy trained on.

Data parallelism: ``trainable`` is the policy wrapped in DDP or FSDP2; each rank trains on its own rollout
with losses normalised by the global minibatch totals, and statistics are added over ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from algorithms.base import Algorithm, roc_auc
from algorithms.buffer import RolloutBuffer
from algorithms.registry import algorithm_spec
from algorithms.statistics import kl_early_stop, role_sums, row_statistics
from models.forward import module_mode
from models.policy import LanguagePolicy
from train import distributed
from train.collector import Collector
from train.config import LearningConfig, RolloutConfig
from train.correction import GapMeter, corrected_targets, score_trainer_logprobs
from train.distributed import Ranks

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class Learner:
    """Trains ``policy`` (through ``trainable``) with ``algorithm``; ``config``: the run's learning section
    (``train.config.LearningConfig``); ``rollout``: its rollout section (``train.config.RolloutConfig``: the
    correction of samples from another engine); ``shuffle``: the generator that orders minibatches (saved with
    checkpoints)."""

    def __init__(self, config: LearningConfig, rollout: RolloutConfig, policy: LanguagePolicy,
                 trainable: torch.nn.Module, algorithm: Algorithm, optimizer: torch.optim.Optimizer, scheduler,
                 collector: Collector, shuffle: torch.Generator, ranks: Ranks, implicit_prm=None):
        self.config, self.rollout, self.policy, self.trainable = config, rollout, policy, trainable
        self.algorithm = algorithm
        self.spec = algorithm_spec(algorithm.name)
        self.optimizer, self.scheduler, self.collector, self.shuffle = optimizer, scheduler, collector, shuffle
        self.temperature = collector.sampling.temperature
        self.ranks, self.implicit_prm = ranks, implicit_prm

    def update(self, buffer: RolloutBuffer, progress) -> dict[str, Any]:
        """Advantages, then ``ppo_epoch`` epochs of minibatch steps; returns statistics. ``progress``: the
        runner's counters (its non-finite step counts are kept here)."""
        config, algorithm = self.config, self.algorithm
        started = time.perf_counter()
        rollout_is = self.rollout.rollout_is
        with self.policy.gathered():
            heldout = self.score_rollout(buffer)
            gap = (score_trainer_logprobs(self.policy, buffer, self.temperature, self.row_adapters) if rollout_is
                   else GapMeter())  # else measured on the first minibatch's forward passes
        targets, rollout_stats = corrected_targets(buffer, algorithm.advantages(buffer), self.rollout)
        sums, weights = defaultdict(float), defaultdict(float)
        grad_norms, steps, stopped_early = [], 0, False
        with module_mode(self.policy, training=True):  # checkpointing acts; eval mode again for sampling
            for _ in range(config.ppo_epoch):
                for minibatch in buffer.minibatches(targets, config.num_mini_batch, config.gradient_cp_steps,
                                                    self.shuffle, skip=algorithm.skippable_rows,
                                                    reduce_totals=self.reduce_totals,
                                                    max_tokens=config.micro_batch_tokens):
                    measured = None if rollout_is or steps or stopped_early else gap  # the policy before any step
                    minibatch_kl, stepped = self.minibatch_step(minibatch, progress, sums, weights, grad_norms,
                                                                measured)
                    steps += stepped
                    stopped_early = kl_early_stop(minibatch_kl, config.target_kl)
                    if stopped_early:
                        break
                if stopped_early:
                    break
        if steps:  # the schedule advances with iterations that updated the policy
            self.scheduler.step()
        if self.ranks.distributed:
            sums, weights = distributed.sum_by_key(sums, weights)
        stats: dict[str, Any] = ({f"loss/{key}": sums[key] / weights[key] for key in sums} | heldout | rollout_stats
                                 | gap.stats())
        trained = buffer.trained(targets)
        if self.implicit_prm is not None:
            stats["loss/implicit_prm"] = self.update_implicit_prm(buffer, trained)
        stats.update({
            "grad/norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "train/optimizer_steps": float(steps), "train/early_stopped": float(stopped_early),
            "train/nonfinite_steps": float(progress.nonfinite_steps),
            "time/update": time.perf_counter() - started,
            "histograms": targets.stats,
        })
        if steps:  # no step, no sample trained on
            stats["train/trained_samples"] = float(distributed.all_reduce_sum([float(trained.sum())])[0])
        for group in self.optimizer.param_groups:
            stats[f"lr/{group.get('name', 'group')}"] = group["lr"]
        return stats

    @property
    def reduce_totals(self):
        """The minibatch totals over every rank (``RolloutBuffer.minibatches``), or None in one process."""
        return distributed.all_reduce_sum if self.ranks.distributed else None

    def score_rollout(self, buffer: RolloutBuffer) -> dict[str, float]:
        """Reference log-probs (KL) and implicit-PRM token rewards of every live action; returns the
        implicit PRM's held-out statistics (``implicit_prm_heldout``)."""
        if not (self.algorithm.needs_reference or self.algorithm.needs_process_rewards):
            return {}
        rows = buffer.rows()
        actions = (rows.action_ids, rows.action_lengths)
        with torch.no_grad():
            if self.algorithm.needs_reference:
                ref = self.policy.ref_log_probs(rows.prompts, actions, self.temperature)
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

    def minibatch_step(self, minibatch, progress, sums: dict, weights: dict, grad_norms: list,
                       gap: GapMeter | None = None) -> tuple[float, bool]:
        """Accumulates the micro-batches' gradients, clips, steps; returns (the minibatch's approx KL,
        whether the optimizer stepped: not when the loss or the gradient norm is non-finite). ``gap``: where
        the forward passes' distance to the sampler's log-probs is added (None: not measured).

        Several ranks: DDP and FSDP2 average the gradients over ranks, so each loss (normalised by the
        global totals) is scaled by the world size. Every rank runs as many forward and backward passes as
        the rank with the most micro-batches (both need them matched), the missing ones zero-gradient
        passes (``idle_backward``).

        Gradients exist only inside this call: they are freed on its way out, stepped or not (held, they
        are a model's worth of memory through the next iteration's generation and evaluation)."""
        passes = len(minibatch)
        if self.ranks.distributed:
            passes = int(distributed.all_reduce_max([passes])[0])
            if passes == 0:
                return 0.0, False  # every rank skipped every row: no gradient anywhere, no step (as in one process)
        kl_sum, kl_weight, finite_loss = 0.0, 0, True
        for k in range(passes):
            with self.gradient_sync(last=k == passes - 1):
                if k >= len(minibatch):
                    self.idle_backward()
                    continue
                batch = minibatch[k]
                micro_stats, finite = self.micro_batch_backward(batch, sums, weights, gap)
                finite_loss &= finite
            kl_sum += float(micro_stats["approx_kl"]) * batch.num_samples
            kl_weight += batch.num_samples
        if self.ranks.distributed:
            kl_sum, kl_weight, nonfinite = distributed.all_reduce_sum([kl_sum, kl_weight, float(not finite_loss)])
            finite_loss = nonfinite == 0
        grad_norm = self.clipped_grad_norm()
        kl = kl_sum / max(kl_weight, 1)
        stepped = finite_loss and math.isfinite(grad_norm)
        if stepped:
            progress.nonfinite_in_a_row = 0
            grad_norms.append(grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not stepped:
            self.skip_nonfinite_step("loss" if not finite_loss else f"gradient norm ({grad_norm})", progress)
        return kl, stepped

    def micro_batch_backward(self, batch, sums: dict, weights: dict,
                             gap: GapMeter | None = None) -> tuple[dict[str, torch.Tensor], bool]:
        """One micro-batch's forward and backward, its statistics added into ``sums``/``weights``; returns
        (its statistics, whether its loss was finite)."""
        scores = self.trainable(batch.prompts, (batch.action_ids, batch.action_lengths), self.temperature,
                                with_entropy=True, with_values=self.spec.critic is not None,
                                adapters=self.row_adapters(batch), critic_prompts=batch.critic_prompts,
                                value_heads=self.row_value_heads(batch))
        loss, micro_stats = self.algorithm.loss(scores, batch)
        if gap is not None:
            gap.add(scores.logprobs, batch.old_logprobs, batch.token_mask)
        finite = bool(torch.isfinite(loss))
        (loss * self.ranks.world_size).backward()
        for key, value in micro_stats.items():
            sums[key] += float(value) * batch.num_samples
            weights[key] += batch.num_samples
        self.add_role_stats(scores, batch, sums, weights)
        return micro_stats, finite

    def clipped_grad_norm(self) -> float:
        """Clips the gradients to ``max_grad_norm`` (0: no clipping); returns their norm before clipping."""
        parameters = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.config.max_grad_norm or math.inf)
        return float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)  # FSDP2: sharded

    def add_role_stats(self, scores, batch, sums: dict, weights: dict) -> None:
        """Each role's mean token entropy, approx KL to the behaviour policy and, with a critic, value loss
        (multi-agent envs), added to ``sums``/``weights`` as ``<role>/<name>`` (logged under ``loss/``)."""
        roles = self.collector.roles
        if not roles or scores.entropy is None:
            return
        with torch.no_grad():
            value_loss = self.algorithm.value_loss_rows(scores, batch) if scores.values is not None else None
            rows = row_statistics(scores.logprobs, scores.entropy, batch, value_loss)
        for key, (total, count) in role_sums(rows, batch.agents, roles).items():
            sums[key] += total
            weights[key] += count

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
        scores = self.trainable([[pad]], [[pad]], self.temperature, with_entropy=True,
                                with_values=self.spec.critic is not None)
        zero = scores.logprobs.sum() * 0.0
        if scores.values is not None:
            zero = zero + scores.values.sum() * 0.0
        zero.backward()

    def skip_nonfinite_step(self, what: str, progress) -> None:
        """Counts a step skipped for a non-finite ``what``; ``max_nonfinite_steps`` in a row stop the run (the
        runner names the last checkpoint, which stays the last good state: nothing is saved)."""
        progress.nonfinite_steps += 1
        progress.nonfinite_in_a_row += 1
        log.warning("iteration %d: non-finite %s; optimizer step skipped (%d in a row, %d in the run)",
                    progress.iteration, what, progress.nonfinite_in_a_row, progress.nonfinite_steps)
        if progress.nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteError(
                f"iteration {progress.iteration}: {progress.nonfinite_in_a_row} optimizer steps in a row had a "
                f"non-finite {what} (--max_nonfinite_steps={self.config.max_nonfinite_steps}); stopped without saving")

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
