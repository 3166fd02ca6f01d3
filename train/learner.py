"""The update of one batch, in the steps the runner calls in order: ``score`` (reference log-probs for the KL,
implicit-PRM token rewards, the trainer's log-probs for the rollout correction), ``targets`` (the algorithm's
advantages, rollout-corrected), ``train`` (epochs of minibatches whose micro-batches accumulate gradients,
clipped, stepped; a non-finite loss or gradient norm skips its step and ``max_nonfinite_steps`` in a row raise
``NonFiniteError``). PRIME's implicit PRM learns from the episodes the policy trains on either while scoring,
before its rewards are computed (``--prime_update before``, PRIME's default), or after the policy's update
(``after``: ``update_implicit_prm_after``).

Roles on base models of their own (``train.members``): the team (``models.team.Team``) scores each row with its
role's model, one loss trains them all, and each model's optimizer steps on its own clipped gradient.

Data parallelism: ``parallel_module`` is the team wrapped in DDP, or the team with its policy sharded by FSDP2;
each rank trains on its own rollout with losses normalised by the global minibatch totals, and statistics are
added over ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from algorithms.base import Algorithm, roc_auc
from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.registry import algorithm_spec
from algorithms.statistics import kl_early_stop, role_sums, row_statistics
from envs.modes import Critic, PrimeUpdate
from models.forward import module_mode
from models.packing import take
from models.team import Team
from train import distributed
from train.config import LearningConfig, PrimeConfig, RolloutConfig
from train.correction import GapMeter, corrected_targets, score_old_log_probs
from train.distributed import Ranks

log = logging.getLogger(__name__)


def grad_norm_key(name: str | None) -> str:
    """The logged gradient norm of the policy (``name`` None) or of a member's model (its role)."""
    return "grad/norm" if name is None else f"grad/{name}/norm"


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass(frozen=True)
class Scores:
    """What scoring a batch measured besides what it wrote into the buffer: the implicit PRM's ``heldout``
    statistics (``process_rewards``; empty without one) and the sampler/trainer log-prob ``gap``, filled
    here under ``rollout_is``, else by ``Learner.train`` on the forward passes before its first step."""

    heldout: dict[str, float]
    gap: GapMeter


@dataclass
class UpdateStats:
    """The update's statistics as they add up: ``sums[key] / weights[key]`` is each loss term's mean over the
    samples (or a role's rows) it was measured on; ``grad_norms``: one {None: the policy's, role: a member's}
    per optimizer step taken."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    weights: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    grad_norms: list[dict[str | None, float]] = field(default_factory=list)

    def add(self, key: str, total: float, weight: float) -> None:
        self.sums[key] += total
        self.weights[key] += weight


@dataclass
class NonfiniteCount:
    """Optimizer steps skipped for a non-finite loss or gradient norm: ``before`` this update in the run,
    ``in_update`` in it, the latest ``in_a_row`` of all of them in a row."""

    before: int
    in_a_row: int
    in_update: int = 0


@dataclass(frozen=True)
class MinibatchStep:
    """What one minibatch's step did: its approx ``kl``, whether the optimizers ``stepped``, and what was
    non-finite when that skipped the step ("loss", "gradient norm (nan)"; else None)."""

    kl: float
    stepped: bool
    nonfinite: str | None


@dataclass(frozen=True)
class TrainResult:
    """What ``Learner.train`` did: ``optimizer_steps`` taken, ``nonfinite_steps`` skipped for a non-finite loss
    or gradient norm, the ``nonfinite_in_a_row`` at its end (counting those before it), and the statistics
    logged (losses, gradient norm, the log-prob gap, early stop, trained samples)."""

    optimizer_steps: int
    nonfinite_steps: int
    nonfinite_in_a_row: int
    stats: dict[str, float]


class Learner:
    """Trains ``team`` (the policy and its members, ``models.team.Team``; through ``parallel_module``) with
    ``algorithm``; ``optimizer`` steps the policy, ``member_optimizers`` ({role: optimizer}) each member, each
    model's gradient clipped on its own. ``config``: the run's learning section (``train.config.LearningConfig``);
    ``rollout``: its rollout section (``train.config.RolloutConfig``: the correction of samples from another
    engine); ``minibatch_rng``: the generator that orders minibatches (saved with checkpoints). What it needs of
    how the batch was collected: the sampling ``temperature`` (log-probs are scored at it), the agent slots'
    ``roles`` (None: one agent), what scores each slot's rows (``voices``: its LoRA adapter or its member's role,
    ``RoleModels.voices``; a slot missing is the policy's own) and what a multi-agent ``critic`` reads
    (``Critic.PER_ROLE``: a value head per role; None: no such critic)."""

    def __init__(self, config: LearningConfig, rollout: RolloutConfig, team: Team,
                 parallel_module: torch.nn.Module, algorithm: Algorithm, optimizer: torch.optim.Optimizer,
                 minibatch_rng: torch.Generator, ranks: Ranks, implicit_prm=None, prime: PrimeConfig = PrimeConfig(),
                 member_optimizers: Mapping[str, torch.optim.Optimizer] | None = None, *, temperature: float,
                 roles: tuple[str, ...] | None = None, voices: dict[int, str] | None = None,
                 critic: Critic | None = None):
        self.config, self.rollout, self.team, self.parallel_module = config, rollout, team, parallel_module
        self.algorithm = algorithm
        self.spec = algorithm_spec(algorithm.name)
        self.minibatch_rng = minibatch_rng
        # None: the policy's optimizer; a role: its member's
        self.optimizers: dict[str | None, torch.optim.Optimizer] = {None: optimizer, **(member_optimizers or {})}
        self.temperature, self.roles, self.voices, self.critic = temperature, roles, voices or {}, critic
        self.ranks, self.implicit_prm, self.prime = ranks, implicit_prm, prime

    def score(self, buffer: RolloutBuffer) -> Scores:
        """Writes into ``buffer`` what the loss needs of other models: the reference log-probs of every live
        action (KL), the implicit PRM's token rewards (PRIME: ``process_rewards``) and, under ``rollout_is``,
        the trainer's log-probs (``score_old_log_probs``)."""
        heldout = self.process_rewards(buffer) if self.algorithm.needs_process_rewards else {}
        with self.team.gathered(), torch.no_grad():
            if self.algorithm.needs_reference:
                rows = buffer.rows()
                ref = self.team.ref_log_probs(rows.prompt_ids, (rows.action_ids, rows.action_lengths),
                                              self.temperature, adapters=self.row_adapters(rows))
                buffer.ref_log_probs = buffer.scatter_tokens(rows.index, ref)
            gap = (score_old_log_probs(self.team, buffer, self.temperature, self.row_adapters)
                   if self.rollout.rollout_is else GapMeter())
        return Scores(heldout, gap)

    def process_rewards(self, buffer: RolloutBuffer) -> dict[str, float]:
        """PRIME: writes the implicit PRM's token rewards of the episodes the policy will train on (the groups
        that pass the prompt filter, ``algorithm.kept``) into ``buffer.token_rewards``, 0 elsewhere. Under
        ``--prime_update before`` the PRM first takes its step on those episodes, so that their rewards already
        carry what their outcomes taught it. Returns how well it ranks their outcomes (``implicit_prm_ranking``):
        ``heldout``, by its scores before its step on them, read off the pass its step or its rewards take, with
        ``--implicit_prm_heldout_all`` ``heldout_all`` over every live episode too, and under ``before``
        ``after_step``, by the scores its rewards carry; and under ``before`` its step's loss and gradient norm."""
        kept = self.algorithm.kept(buffer)
        rows = buffer.rows(kept)
        actions = (rows.action_ids, rows.action_lengths)
        reference = self.implicit_prm.reference_log_probs(rows.prompt_ids, actions)  # frozen: one pass serves both
        stats = {}
        if self.prime.prime_update is PrimeUpdate.BEFORE:
            stats, unseen = self.implicit_prm_step(buffer, rows, reference)
        process, scores = self.implicit_prm.token_rewards(rows.prompt_ids, actions, batch_max=self.batch_max,
                                                          ref_log_probs=reference)
        if self.prime.prime_update is PrimeUpdate.AFTER:
            unseen = scores
        else:  # the scores its rewards carry, after its step on these episodes (PRIME's code: dpo_acc_after)
            stats |= self.implicit_prm_ranking(buffer, rows.index, scores, "after_step")
        buffer.token_rewards = buffer.scatter_tokens(rows.index, process)
        stats |= self.implicit_prm_ranking(buffer, rows.index, unseen, "heldout")
        if self.prime.implicit_prm_heldout_all:
            others = buffer.rows(buffer.live & ~kept)
            other_scores = self.implicit_prm.outcome_scores(others.prompt_ids,
                                                            (others.action_ids, others.action_lengths))
            stats |= self.implicit_prm_ranking(buffer, torch.cat([rows.index, others.index]),
                                               torch.cat([unseen.cpu(), other_scores.cpu()]), "heldout_all")
        return stats

    def batch_max(self, value: float) -> float:
        """The largest of every rank's ``value`` (this one's in one process)."""
        return float(distributed.all_reduce_max([value])[0]) if self.ranks.distributed else value

    def targets(self, buffer: RolloutBuffer) -> tuple[AdvantageEstimate, dict[str, float]]:
        """The algorithm's advantages (and critic targets) for ``buffer``, rollout-corrected
        (``corrected_targets``), and the correction's statistics."""
        return corrected_targets(buffer, self.algorithm.advantages(buffer), self.rollout)

    def train(self, buffer: RolloutBuffer, targets: AdvantageEstimate, gap: GapMeter, iteration: int,
              nonfinite_steps: int, nonfinite_in_a_row: int) -> TrainResult:
        """``ppo_epoch`` epochs of minibatch steps on ``targets``, stopped once a minibatch's approx KL passes
        ``target_kl``. ``gap``: measured here on the forward passes before the first step unless the scoring
        pass did (``rollout_is``). ``nonfinite_steps``/``nonfinite_in_a_row``: the run's skipped steps so far
        (``count_nonfinite`` raises ``NonFiniteError`` at the ``max_nonfinite_steps``-th in a row)."""
        stats, nonfinite = UpdateStats(), NonfiniteCount(nonfinite_steps, nonfinite_in_a_row)
        steps, stopped_early = 0, False
        with module_mode(self.team, training=True):  # checkpointing acts; eval mode again for sampling
            for minibatch in self.minibatches(buffer, targets):
                step = self.minibatch_step(minibatch, stats, self.gap_before_first_step(gap, steps))
                steps += step.stepped
                self.count_nonfinite(step, nonfinite, iteration)
                stopped_early = kl_early_stop(step.kl, self.config.target_kl)
                if stopped_early:
                    break
        logged = self.logged_stats(stats, gap, steps, stopped_early, buffer, targets)
        return TrainResult(steps, nonfinite.in_update, nonfinite.in_a_row, logged)

    def gap_before_first_step(self, gap: GapMeter, steps: int) -> GapMeter | None:
        """Where a forward pass adds its log-probs' distance to the sampler's: ``gap`` while no step has been taken
        (the policy the sampler copied), None after the first step or when the scoring pass measured it
        (``rollout_is``)."""
        return None if self.rollout.rollout_is or steps else gap

    def count_nonfinite(self, step: MinibatchStep, count: NonfiniteCount, iteration: int) -> None:
        """Counts ``step`` into ``count``: a step taken ends a run of non-finite ones; one skipped for a non-finite
        value is logged and the ``max_nonfinite_steps``-th in a row raises (``skipped_nonfinite``)."""
        if step.stepped:
            count.in_a_row = 0
        elif step.nonfinite is not None:
            count.in_update, count.in_a_row = count.in_update + 1, count.in_a_row + 1
            self.skipped_nonfinite(step.nonfinite, iteration, count.before + count.in_update, count.in_a_row)

    def logged_stats(self, stats: UpdateStats, gap: GapMeter, steps: int, stopped_early: bool,
                     buffer: RolloutBuffer, targets: AdvantageEstimate) -> dict[str, float]:
        """What the update logs: the losses' means (over every rank), the log-prob gap, each model's mean gradient
        norm, the optimizer steps, the early stop and, when a step was taken, the samples trained on."""
        sums, weights = stats.sums, stats.weights
        if self.ranks.distributed:
            sums, weights = distributed.sum_by_key(sums, weights)
        norms = stats.grad_norms
        logged = {f"loss/{key}": sums[key] / weights[key] for key in sums} | gap.stats() | {
            grad_norm_key(name): float(np.mean([step_norms[name] for step_norms in norms])) if norms else 0.0
            for name in self.optimizers} | {
            "train/optimizer_steps": float(steps), "train/early_stopped": float(stopped_early)}
        if steps:  # no step, no sample trained on
            trained = float(buffer.update_slots(targets).sum())
            logged["train/trained_samples"] = float(distributed.all_reduce_sum([trained])[0])
        return logged

    def minibatches(self, buffer: RolloutBuffer, targets: AdvantageEstimate) -> Iterator[list[Batch]]:
        """``ppo_epoch`` epochs of ``buffer``'s minibatches (``RolloutBuffer.minibatches``), each epoch ordered
        by ``minibatch_rng`` when it begins."""
        config = self.config
        for _ in range(config.ppo_epoch):
            yield from buffer.minibatches(targets, config.num_mini_batch, config.gradient_cp_steps, self.minibatch_rng,
                                          skip=self.algorithm.skippable_rows, reduce_totals=self.reduce_totals,
                                          max_tokens=config.micro_batch_tokens)

    def learning_rates(self) -> dict[str, float]:
        """``lr/<group>``: each parameter group's learning rate now; a member's ``lr/<role>/<group>``."""
        return {f"lr/{'' if name is None else name + '/'}{group.get('name', 'group')}": group["lr"]
                for name, optimizer in self.optimizers.items() for group in optimizer.param_groups}

    @property
    def reduce_totals(self):
        """The minibatch totals over every rank (``RolloutBuffer.minibatches``), or None in one process."""
        return distributed.all_reduce_sum if self.ranks.distributed else None

    def implicit_prm_ranking(self, buffer: RolloutBuffer, index: torch.Tensor, scores: torch.Tensor,
                             name: str) -> dict[str, float]:
        """PRIME: how well the implicit PRM predicts outcomes: ``implicit_prm/<name>_auc`` and ``_accuracy``, the
        ROC-AUC and accuracy (score > 0) of its outcome scores ``scores`` [B] of the slots ``index`` [B] against
        whether their episode's answer verified. Over the filtered groups, each holding a right and a wrong answer
        to one problem, the AUC is how well it ranks answers to the same problem: what the process stream's
        leave-one-out advantages read. Every rank's rows count; the AUC is NaN while the
        rows hold one class only."""
        labels, scores = buffer.episode_correct_at(index).cpu(), scores.float().cpu()
        if self.ranks.distributed:
            gathered = distributed.all_gather_objects((scores, labels))
            scores, labels = (torch.cat(parts) for parts in zip(*gathered))
        both = 0 < int(labels.sum()) < len(labels)
        return {f"implicit_prm/{name}_auc": roc_auc(scores, labels) if both else math.nan,
                f"implicit_prm/{name}_accuracy": float(((scores > 0).float() == labels).float().mean())}

    def minibatch_step(self, minibatch: list[Batch], stats: UpdateStats,
                       gap: GapMeter | None = None) -> MinibatchStep:
        """Accumulates the micro-batches' gradients, clips, steps. ``gap``: where the forward passes' distance to
        the sampler's log-probs is added (None: not measured); ``stats``: where the losses' statistics and a step's
        gradient norms go. One model's non-finite gradient skips every model's step, as one loss made them all.

        Several ranks: DDP and FSDP2 average the gradients over ranks, so each loss (normalised by the
        global totals) is scaled by the world size. Every rank runs as many forward and backward passes as
        the rank with the most micro-batches (``matched_passes``), and the minibatch's KL and finiteness are
        taken over every rank, so that all ranks step or skip together.

        Gradients exist only inside this call: they are freed on its way out, stepped or not (held, they
        are a model's worth of memory through the next iteration's generation and evaluation)."""
        passes = self.matched_passes(minibatch)
        if passes == 0:
            return MinibatchStep(0.0, False, None)  # every rank skipped every row: no gradient, no step
        kl_sum, kl_weight, finite_loss = self.accumulate_gradients(minibatch, passes, stats, gap)
        if self.ranks.distributed:
            kl_sum, kl_weight, nonfinite = distributed.all_reduce_sum([kl_sum, kl_weight, float(not finite_loss)])
            finite_loss = nonfinite == 0
        return self.optimizer_step(kl_sum / max(kl_weight, 1), finite_loss, stats)

    def matched_passes(self, minibatch: list[Batch]) -> int:
        """The forward and backward passes this rank runs for ``minibatch``: its micro-batches or, with several
        ranks, the most any rank has (DDP and FSDP2 need them matched; the missing ones are ``idle_backward``)."""
        if not self.ranks.distributed:
            return len(minibatch)
        return int(distributed.all_reduce_max([len(minibatch)])[0])

    def accumulate_gradients(self, minibatch: list[Batch], passes: int, stats: UpdateStats,
                             gap: GapMeter | None) -> tuple[float, int, bool]:
        """``passes`` forward and backward passes: the micro-batches', then idle ones; returns the approx KL summed
        over the samples, their count, and whether every loss was finite."""
        kl_sum, kl_weight, finite_loss = 0.0, 0, True
        for k in range(passes):
            with self.gradient_sync(last=k == passes - 1):
                if k >= len(minibatch):
                    self.idle_backward()
                    continue
                batch = minibatch[k]
                micro_stats, finite = self.micro_batch_backward(batch, stats, gap)
                finite_loss &= finite
            kl_sum += float(micro_stats["approx_kl"]) * batch.num_samples
            kl_weight += batch.num_samples
        return kl_sum, kl_weight, finite_loss

    def optimizer_step(self, kl: float, finite_loss: bool, stats: UpdateStats) -> MinibatchStep:
        """Clips each model's gradient and steps every optimizer when the loss and every gradient norm are finite,
        recording the norms in ``stats``; frees the gradients either way."""
        norms = {name: self.clipped_grad_norm(optimizer) for name, optimizer in self.optimizers.items()}
        bad_norm = next((norm for norm in norms.values() if not math.isfinite(norm)), None)
        stepped = finite_loss and bad_norm is None
        if stepped:
            stats.grad_norms.append(norms)
        for optimizer in self.optimizers.values():
            if stepped:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        nonfinite = None if stepped else "loss" if not finite_loss else f"gradient norm ({bad_norm})"
        return MinibatchStep(kl, stepped, nonfinite)

    def micro_batch_backward(self, batch, stats: UpdateStats,
                             gap: GapMeter | None = None) -> tuple[dict[str, torch.Tensor], bool]:
        """One micro-batch's forward and backward, its statistics added into ``stats``; returns (its statistics,
        whether its loss was finite)."""
        scores = self.parallel_module(batch.prompt_ids, (batch.action_ids, batch.action_lengths), self.temperature,
                                      with_entropy=True, with_values=self.spec.critic is not None,
                                      adapters=self.row_adapters(batch), critic_prompts=batch.critic_prompt_ids,
                                      value_heads=self.row_value_heads(batch))
        loss, micro_stats = self.algorithm.loss(scores, batch)
        if gap is not None:
            gap.add(scores.log_probs, batch.old_log_probs, batch.token_mask)
        finite = bool(torch.isfinite(loss))
        (loss * self.ranks.world_size).backward()
        for key, value in micro_stats.items():
            stats.add(key, float(value) * batch.num_samples, batch.num_samples)
        self.add_role_stats(scores, batch, stats)
        return micro_stats, finite

    def clipped_grad_norm(self, optimizer: torch.optim.Optimizer) -> float:
        """Clips the gradients of ``optimizer``'s parameters to ``max_grad_norm`` (0: no clipping); returns their
        norm before clipping."""
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.config.max_grad_norm or math.inf)
        return float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)  # FSDP2: sharded

    def add_role_stats(self, scores, batch, stats: UpdateStats) -> None:
        """Each role's mean token entropy, approx KL to the behaviour policy and, with a critic, value loss
        (multi-agent envs), added to ``stats`` as ``<role>/<name>`` (logged under ``loss/``)."""
        roles = self.roles
        if not roles or scores.entropy is None:
            return
        with torch.no_grad():
            value_loss = self.algorithm.value_loss_rows(scores, batch) if scores.values is not None else None
            rows = row_statistics(scores.log_probs, scores.entropy, batch, value_loss)
        for key, (total, count) in role_sums(rows, batch.agents, roles).items():
            stats.add(key, total, count)

    def row_adapters(self, batch) -> list[str | None] | None:
        """What scores each row of ``batch``: its member's role or its role adapter (``voices``), else None; None
        when no slot has one (every row is the policy's own)."""
        if not self.voices:
            return None
        return [self.voices.get(agent) for agent in batch.agents.tolist()]

    def row_value_heads(self, batch) -> list[int] | None:
        """The value head each row of ``batch`` is read from (per-role critics: its agent's), else None."""
        if self.critic != Critic.PER_ROLE:
            return None
        return batch.agents.tolist()

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP reduces gradients at the minibatch's last backward only (no_sync before it); FSDP2 reduces
        at every backward, keeping only its shard of the gradient between micro-batches."""
        if not self.ranks.distributed or last or self.team.sharded:
            return contextlib.nullcontext()
        return self.parallel_module.no_sync()

    def idle_backward(self) -> None:
        """A backward of zero loss through DDP or FSDP2 on one placeholder token: this rank's part of the
        gradient reduction when it has fewer micro-batches than another rank (no gradient of its own)."""
        pad = self.team.tokenizer.pad_token_id
        scores = self.parallel_module([[pad]], [[pad]], self.temperature, with_entropy=True,
                                      with_values=self.spec.critic is not None)
        zero = scores.log_probs.sum() * 0.0
        if scores.values is not None:
            zero = zero + scores.values.sum() * 0.0
        zero.backward()

    def skipped_nonfinite(self, what: str, iteration: int, nonfinite_steps: int, nonfinite_in_a_row: int) -> None:
        """Logs an optimizer step skipped for a non-finite ``what`` (``nonfinite_steps`` in the run so far,
        ``nonfinite_in_a_row`` of them the latest in a row); ``max_nonfinite_steps`` in a row stop the run (the
        runner names the last checkpoint, which stays the last good state: nothing is saved)."""
        log.warning("iteration %d: non-finite %s; optimizer step skipped (%d in a row, %d in the run)",
                    iteration, what, nonfinite_in_a_row, nonfinite_steps)
        if nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteError(
                f"iteration {iteration}: {nonfinite_in_a_row} optimizer steps in a row had a non-finite {what} "
                f"(--max_nonfinite_steps={self.config.max_nonfinite_steps}); stopped without saving")

    def update_implicit_prm_after(self, buffer: RolloutBuffer, targets: AdvantageEstimate) -> dict[str, float]:
        """PRIME under ``--prime_update after``: one step of the implicit PRM on the actions the policy trained on
        (``buffer.update_slots(targets)``); returns its loss and gradient norm. Nothing (``{}``) without a PRM or
        under ``before``."""
        if self.implicit_prm is None or self.prime.prime_update is not PrimeUpdate.AFTER:
            return {}
        return self.implicit_prm_step(buffer, buffer.rows(buffer.update_slots(targets)))[0]

    def implicit_prm_step(self, buffer: RolloutBuffer, rows: Batch,
                          reference: torch.Tensor | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """``--implicit_prm_num_mini_batch`` steps of the implicit PRM on ``rows``, each on the next share of them
        in order (PRIME's code iterates its batch unshuffled), labelled by whether their episode's answer verified,
        its gradients accumulated over micro-batches of at most ``micro_batch_tokens`` forwarded positions as the
        policy's are (``reference``: the rows' reference log-probs [B, L], when already computed); returns
        ``loss/implicit_prm`` and ``implicit_prm/grad_norm`` (the means over its steps of the loss and of the norm
        before ``--implicit_prm_grad_clip``; both NaN when no rank has a row) and its outcome scores [B] of
        ``rows``, each taken before the step on its share."""
        labels = buffer.episode_correct_at(rows.index)
        scores, losses, norms = torch.zeros(rows.num_samples), [], []
        for share in torch.tensor_split(torch.arange(rows.num_samples), self.prime.implicit_prm_num_mini_batch):
            total = int(distributed.all_reduce_sum([len(share)])[0])  # over every rank
            if total == 0:
                continue
            loss = 0.0
            for part in self.micro_batch_rows(buffer, rows, share):
                width = max(int(rows.action_lengths[part].max()), 1)  # as wide as the part's scores: its longest
                part_loss, scores[part] = self.implicit_prm.accumulate(
                    take(rows.prompt_ids, part.tolist()), (rows.action_ids[part, :width], rows.action_lengths[part]),
                    labels[part], total, None if reference is None else reference[part, :width])
                loss += part_loss
            norms.append(self.implicit_prm.step(distributed.sum_in_place if self.ranks.distributed else None))
            losses.append(float(distributed.all_reduce_sum([loss])[0]))
        if not losses:
            return {"loss/implicit_prm": math.nan, "implicit_prm/grad_norm": math.nan}, scores
        return {"loss/implicit_prm": float(np.mean(losses)), "implicit_prm/grad_norm": float(np.mean(norms))}, scores

    def micro_batch_rows(self, buffer: RolloutBuffer, rows: Batch,
                         positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The positions in ``rows`` [B] (of ``positions``, default all of them) of each micro-batch of at most
        ``micro_batch_tokens`` forwarded positions (``RolloutBuffer.within_tokens``; 0: one micro-batch); none for
        no rows (a rank whose groups the filter dropped joins the step with zero gradients)."""
        positions = torch.arange(rows.num_samples) if positions is None else positions
        if not len(positions):
            return []
        if not self.config.micro_batch_tokens:
            return [positions]
        position = {slot: row for row, slot in zip(positions.tolist(), rows.index[positions].tolist())}
        return [torch.tensor([position[slot] for slot in part.tolist()], dtype=torch.long)
                for part in buffer.within_tokens(rows.index[positions], self.config.micro_batch_tokens)]
