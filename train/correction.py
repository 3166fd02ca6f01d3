"""What the rollout options change in a batch between its advantages and its loss, and the gap they correct.

Cut-off answers (``mask_truncated_completions``, TRL's): actions the generator stopped at its token limit
leave the loss; their returns still entered their group's baseline. Rollout correction (``rollout_is``,
verl's): the trainer scores every action before the update (``old_log_probs``, which the ratio is then
taken against), and each action is weighted by its truncated trainer/sampler ratio or masked where the
ratio leaves a band (``algorithms.rollout_correction``).

The gap between the sampler's log-probs and the trainer's is logged every iteration under ``rollout/``: from
the scoring pass when ``rollout_is`` is on, else from the first minibatch's forward passes (the policy
before its first step of the iteration; free, on the rows that minibatch forwards).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from algorithms.buffer import RolloutBuffer, AdvantageEstimate
from algorithms.rollout_correction import gap_sums, log_ratio, truncated_weights, within_band
from envs.modes import RolloutIsLevel, RolloutIsMode
from train import distributed
from train.config import RolloutConfig


class GapMeter:
    """The sampler/trainer log-prob gap over micro-batches and ranks (``gap_sums``)."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.max_ratio = 0.0

    def add(self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> None:
        """``trainer``, ``sampler``, ``mask``: [B, L] log-probs of the same tokens and the real tokens."""
        sums = gap_sums(trainer.detach().float(), sampler.float(), mask)
        for key in ("abs_diff", "kl", "tokens"):
            self.sums[key] += float(sums[key])
        self.max_ratio = max(self.max_ratio, float(sums["max_ratio"]))

    def stats(self) -> dict[str, float]:
        """rollout/logprob_abs_diff and rollout/logprob_kl (token means), rollout/max_ratio, over every rank."""
        abs_diff, kl, tokens = distributed.all_reduce_sum([self.sums[key] for key in ("abs_diff", "kl", "tokens")])
        if tokens == 0:
            return {}
        return {"rollout/logprob_abs_diff": abs_diff / tokens, "rollout/logprob_kl": kl / tokens,
                "rollout/max_ratio": float(distributed.all_reduce_max([self.max_ratio])[0])}


def rank_means(parts: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{key: sum / count} of ``parts`` {key: (sum, count)}, added over ranks (NaN for a count of 0)."""
    totals = distributed.all_reduce_sum([value for pair in parts.values() for value in pair])
    return {key: totals[2 * k] / totals[2 * k + 1] if totals[2 * k + 1] else math.nan for k, key in enumerate(parts)}


def corrected_targets(buffer: RolloutBuffer, targets: AdvantageEstimate,
                      rollout: RolloutConfig) -> tuple[AdvantageEstimate, dict]:
    """``targets`` without the actions the options drop (cut-off ones; those outside the rollout-IS band), the
    TIS weights written to ``buffer.rollout_weights``, and the statistics to log. Unchanged with every option
    off. ``buffer.old_log_probs`` must be set when ``rollout.rollout_is``."""
    live = buffer.live
    drop = torch.zeros_like(live)
    parts: dict[str, tuple[float, float]] = {}
    if rollout.mask_truncated_completions:
        drop |= buffer.cut
    if rollout.rollout_is:
        mask = buffer.token_mask().float()
        log_rho = log_ratio(buffer.old_log_probs, buffer.rollout_log_probs, mask, rollout.rollout_is_level)
        counted = mask if rollout.rollout_is_level == RolloutIsLevel.TOKEN else live[..., None].float()
        if rollout.rollout_is_mode == RolloutIsMode.TRUNCATE:
            buffer.rollout_weights = truncated_weights(log_rho, rollout.rollout_is_threshold)
            capped = (log_rho > math.log(rollout.rollout_is_threshold)).float()
            parts["rollout/is_weight_mean"] = float((buffer.rollout_weights * counted).sum()), float(counted.sum())
            parts["rollout/is_capped_share"] = float((capped * counted).sum()), float(counted.sum())
        else:
            outside = live & ~within_band(log_rho, *rollout.rollout_is_band)
            drop |= outside
            parts["rollout/is_masked_share"] = float(outside.sum()), float(live.sum())
    stats = rank_means(parts) if parts else {}
    if drop.any():
        targets = dataclasses.replace(targets, keep=buffer.update_slots(targets) & ~drop)
    return targets, stats


@torch.no_grad()
def score_old_log_probs(policy, buffer: RolloutBuffer, temperature: float, adapters) -> GapMeter:
    """Writes the trainer's log-probs of every live action to ``buffer.old_log_probs`` (``adapters``: the
    rows' role adapters or None) and returns their gap to the sampler's."""
    rows = buffer.rows()
    meter = GapMeter()
    if rows.num_samples == 0:
        buffer.old_log_probs = torch.zeros_like(buffer.rollout_log_probs)
        return meter
    scores = policy.score_actions(rows.prompt_ids, (rows.action_ids, rows.action_lengths), temperature,
                                  with_entropy=False, adapters=adapters(rows))
    buffer.old_log_probs = buffer.scatter_tokens(rows.index, scores.log_probs)
    meter.add(scores.log_probs, rows.old_log_probs, rows.token_mask)
    return meter
