"""RLOO with PRIME's reward combination: leave-one-out centring computed separately for the outcome
stream (verified answer) and the implicit-PRM process stream (per-token rewards), then summed, turned into
per-token returns and standardised over the batch (PRIME, arXiv 2502.01456). The centring and the
standardisation are its released code's (``compute_rloo_returns``): the standardisation puts the two streams'
weights on a common scale."""

from __future__ import annotations

import torch

from algorithms.appo import normalized
from algorithms.base import ActionScores, BaseAlgorithm, reward_kl, token_policy_loss, zero_advantage_rows
from algorithms.buffer import Batch, RolloutBuffer, AdvantageEstimate
from algorithms.losses import discounted_reverse_cumsum, group_index, group_means
from envs.modes import AgentGroups, ProcessBaseline


def leave_one_out_centred(rewards: torch.Tensor, reward_mask: torch.Tensor, group_ids: torch.Tensor,
                          baseline: ProcessBaseline = ProcessBaseline.TOKEN) -> torch.Tensor:
    """PRIME's leave-one-out centring of one reward stream, per token [B, L], 0 off ``reward_mask``.

    rewards: [B, L] the stream's rewards; reward_mask: [B, L] where the stream pays (every real token for the
        process stream, each response's last token for the outcome); group_ids: [B].
    With R_j the sum of response j's rewards, |j| the size of its ``reward_mask``, n its group's size, and m_j
    R_j / |j| (``token``, PRIME's code) or R_j / |i| (``response``, response i's own size):
        a_{i,t} = (n r_{i,t} - sum_j m_j) / (n - 1) = r_{i,t} - mean_{j != i} m_j + (r_{i,t} - m_i) / (n - 1),
    the sum over all n responses of the group, i's own included. A stream paid once per response (the outcome:
    r_{i,t} = m_i) gets the plain leave-one-out baseline, r_i - mean_{j != i} r_j, either way; a token of the
    process stream keeps in addition its own deviation from its response's mean, over n - 1. Summed over response
    i, ``token`` gives R_i - |i| mean_{j != i} R_j / |j| (a baseline that grows with its length), ``response``
    R_i - mean_{j != i} R_j.
    """
    groups, sizes = group_index(group_ids, min_size=2)
    mask = reward_mask.to(rewards.dtype)
    counts = mask.sum(-1).clamp(min=1)  # [B] |j|
    totals = (rewards * mask).sum(-1)  # [B] R_j
    per_response = baseline is ProcessBaseline.RESPONSE
    group_sums = (group_means(totals if per_response else totals / counts, groups, sizes) * sizes)[groups]
    if per_response:  # sum_j R_j spread evenly over response i's own positions
        group_sums = group_sums / counts
    n = sizes[groups, None].to(rewards.dtype)
    return (n * rewards - group_sums[:, None]) / (n - 1) * mask


def rloo_returns(
    outcome: torch.Tensor,
    group_ids: torch.Tensor,
    token_mask: torch.Tensor,
    process: torch.Tensor | None = None,
    outcome_coef: float = 1.0,
    process_coef: float = 1.0,
    gamma: float = 1.0,
    process_baseline: ProcessBaseline = ProcessBaseline.TOKEN,
) -> torch.Tensor:
    """Per-token returns [B, L] used as advantages.

    outcome: [B] verified reward of each response, paid at its last token.
    process: [B, L] implicit-PRM token rewards (optional), paid on every real token.
    token_mask: [B, L] 1 on each response's real tokens (from true lengths).
    Each stream is centred within its group by ``leave_one_out_centred`` (a^o, a^p; the process stream's with
    ``process_baseline``), before the returns are taken.
    Returns sum_{s >= t} gamma^(s-t) (outcome_coef * a^o_s + process_coef * a^p_s) on real tokens.
    """
    mask = token_mask.to(outcome.dtype)
    lengths = mask.sum(-1).long()
    last_token = torch.nn.functional.one_hot((lengths - 1).clamp(min=0), mask.shape[-1]).to(outcome.dtype) * mask
    centred = outcome_coef * leave_one_out_centred(outcome[:, None] * last_token, last_token, group_ids)
    if process is not None:
        centred = centred + process_coef * leave_one_out_centred(process, mask, group_ids, process_baseline)
    return discounted_reverse_cumsum(centred, gamma) * mask


def filter_groups(
    correct: torch.Tensor, group_ids: torch.Tensor, accuracy_lower_bound: float, accuracy_upper_bound: float,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """PRIME's online prompt filter: keep mask [B] of responses whose group's accuracy (mean of
    ``correct`` [B]) lies in [lower, upper], and (given ``cut`` [B], the responses cut at the token limit)
    none of whose responses was cut; all-right and all-wrong groups teach nothing, and a group of one (a role
    that acted in one episode of its group) has no leave-one-out baseline."""
    groups, sizes = group_index(group_ids)
    accuracy = group_means(correct.to(torch.float64), groups, sizes)
    keep = (accuracy >= accuracy_lower_bound) & (accuracy <= accuracy_upper_bound) & (sizes >= 2)
    if cut is not None:
        keep &= group_means(cut.to(torch.float64), groups, sizes) == 0
    return keep[groups]


class RLOO(BaseAlgorithm):
    """RLOO with PRIME: outcome and implicit-PRM token rewards are centred separately within each prompt
    group (``rloo_returns``); groups whose accuracy lies outside [accuracy_lower_bound, accuracy_upper_bound]
    (with ``filter_truncated``, also those holding a response cut at the token limit) are dropped first
    (PRIME's online filter, ``kept``), keeping at most ``max_groups``. With
    ``normalize_advantages`` the returns are standardised over the kept tokens of the batch. The loss is the
    per-token clipped surrogate on those advantages; a KL in the reward (``use_kl_in_reward``) is summed into
    the outcome stream."""

    name = "RLOO"

    @property
    def needs_process_rewards(self) -> bool:
        """With process_coef 0 the implicit PRM's stream weighs nothing: no PRM is built, scored or trained."""
        return self.config.process_coef > 0

    def kept_episodes(self, buffer: RolloutBuffer) -> torch.Tensor:
        """[E] episodes (E = N * A) of the groups that pass PRIME's filter, at most ``max_groups`` of them:
        what the policy trains on, and what the implicit PRM scores and learns from."""
        config = self.config
        group_ids = buffer.episode_group_ids(per_agent=config.agent_groups != AgentGroups.JOINT).flatten()
        correct = buffer.episode_correct().flatten()
        acted = buffer.acted().flatten()
        keep = torch.zeros_like(acted)
        cut = buffer.episode_cut().flatten() if config.filter_truncated else None
        keep[acted] = filter_groups(correct[acted], group_ids[acted], config.accuracy_lower_bound,
                                    config.accuracy_upper_bound, None if cut is None else cut[acted])
        if config.max_groups is not None:
            kept_groups = group_ids[keep].unique(sorted=False)[: config.max_groups]
            keep &= torch.isin(group_ids, kept_groups)
        return keep

    def kept(self, buffer: RolloutBuffer) -> torch.Tensor:
        """[T, N, A] the live slots of ``kept_episodes``."""
        return buffer.live & self.kept_episodes(buffer).reshape(buffer.shape[1:])[None]

    def advantages(self, buffer: RolloutBuffer) -> AdvantageEstimate:
        """advantages [T, N, A, L]; ``keep`` drops the filtered-out groups."""
        config = self.config
        outcome = buffer.episode_returns().flatten()  # [E] episodes, E = N * A
        kl = reward_kl(buffer, config)
        if kl is not None:  # the KL penalty summed into the outcome stream
            outcome = outcome - config.kl_coef * kl.sum((0, 3)).flatten()
        group_ids = buffer.episode_group_ids(per_agent=config.agent_groups != AgentGroups.JOINT).flatten()
        keep = self.kept_episodes(buffer)
        kept_slots = buffer.live & keep.reshape(buffer.shape[1:])[None]
        order, token_mask = buffer.episode_token_order()
        process = None if buffer.token_rewards is None else buffer.to_episodes(buffer.token_rewards, order)
        advantages = torch.zeros_like(token_mask, dtype=torch.float32)
        if keep.any():
            advantages[keep] = rloo_returns(outcome[keep], group_ids[keep], token_mask[keep],
                                            None if process is None else process[keep],
                                            process_coef=config.process_coef, gamma=config.gamma,
                                            process_baseline=config.reward_baseline)
        advantages = buffer.from_episodes(advantages, order)
        kept_tokens = buffer.token_mask() & kept_slots[..., None]
        if config.normalize_advantages:
            advantages = normalized(advantages, kept_tokens, self.reduce_sum)
        stats = {"episode_returns": outcome, "kept_fraction": keep.float().mean()[None],
                 "advantages": advantages[kept_tokens]}
        if kl is not None:
            stats["kl_reward"] = kl[buffer.token_mask()]
        return AdvantageEstimate(advantages, keep=kept_slots, stats=stats)

    def loss(self, scores: ActionScores, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return token_policy_loss(scores, batch, batch.advantages, self.config)

    def skippable_rows(self, advantages: torch.Tensor) -> torch.Tensor:
        return zero_advantage_rows(advantages, self.config)
