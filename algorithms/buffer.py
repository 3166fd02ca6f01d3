"""RolloutBuffer: what one iteration of collection produced, shaped [T, N, A] (steps x envs x
agents) and per action token [T, N, A, L], and its minibatch / gradient-accumulation iteration.

Token masks always come from the true action lengths, never from comparing ids with the pad id.
``live`` marks the (t, n, a) slots that hold an action: in episodic collection an env whose episode
ended stops acting. What an algorithm computes from the buffer (advantages, returns, and which live
slots to train on: PRIME's filter drops whole groups) comes back as ``AdvantageEstimate`` and is handed to
``minibatches``; the buffer itself holds only what collection recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from envs.modes import LossAgg


@dataclass(frozen=True)
class AdvantageEstimate:
    """What an algorithm estimates from one buffer to train on: advantages, the critic's returns, which slots.

    advantages: [T, N, A] per action or [T, N, A, L] per token. returns: the critic's targets, same
    shape, or None without a critic. keep: [T, N, A] bool, the live slots to train on (None: every
    live slot). stats: tensors worth logging (e.g. episode returns).
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRecord:
    """What one env step adds to the buffer: the actions taken at ``step`` by the B trained (env, agent) pairs
    ``envs[b], agents[b]``.

    prompt_ids / action_ids / rollout_log_probs: B lists (the prompt, the generated tokens and the sampler's
    log-probs of them, up to L each). group_ids: [B] prompt groups. texts: B decoded actions. values: [B] V(s_t)
    (None without a critic). token_values: [B, L'] with L' <= L (a token critic). critic_prompt_ids: B lists,
    what the critic read instead of the prompt (a multi-agent env's joint transcript), to read again at the
    update. cut: [B] the actions the generator stopped at its token limit (None: none).
    """

    step: int
    envs: Sequence[int]
    agents: Sequence[int]
    prompt_ids: Sequence[list[int]]
    action_ids: Sequence[list[int]]
    rollout_log_probs: Sequence[list[float]]
    group_ids: torch.Tensor
    texts: Sequence[str]
    values: torch.Tensor | None = None
    token_values: torch.Tensor | None = None
    critic_prompt_ids: Sequence[list[int]] | None = None
    cut: Sequence[bool] | None = None


@dataclass
class Batch:
    """One micro-batch of B live slots, flattened. ``L`` is the longest action in it.

    ``weight(agg)`` is the micro-batch's share of its minibatch, counted in tokens where ``agg`` weighs every
    token the same (``LossAgg.TOKEN_MEAN``) and in samples (actions) otherwise: multiplying a micro-batch mean
    by it and summing over the micro-batches gives the minibatch mean with every token (or sample) weighted
    equally, whatever the remainders of the split.
    """

    index: torch.Tensor  # [B] flat slot indices into T * N * A
    agents: torch.Tensor  # [B] the agent slot of each row
    prompt_ids: list[list[int]]  # [B] token ids of each row's prompt
    critic_prompt_ids: list[list[int]] | None  # what the critic reads instead of the prompt (None: the prompt)
    action_ids: torch.Tensor  # [B, L]
    action_lengths: torch.Tensor  # [B]
    token_mask: torch.Tensor  # [B, L] bool, from lengths
    old_log_probs: torch.Tensor  # [B, L] the ratio's denominator: the sampler's log-probs or (rollout_is) the trainer's
    old_values: torch.Tensor | None  # [B] or [B, L] critic values at collection
    ref_log_probs: torch.Tensor | None  # [B, L]
    advantages: torch.Tensor | None  # [B] or [B, L]; None outside training (e.g. reference passes)
    returns: torch.Tensor | None  # [B] or [B, L]
    num_samples: int
    num_tokens: int
    minibatch_samples: int
    minibatch_tokens: int
    rollout_weights: torch.Tensor | None = None  # [B, L] or [B, 1] rollout-correction weights of the policy gradient

    def weight(self, agg: LossAgg) -> float:
        if LossAgg(agg).per_token:
            return self.num_tokens / self.minibatch_tokens
        return self.num_samples / self.minibatch_samples


def forwarded_positions(prompt_lengths: Sequence[int], action_lengths: Sequence[int]) -> int:
    """Positions one pass forwards for rows that share prompts: the distinct prompts (``prompt_lengths``) padded
    to the longest, then the rows' actions (``action_lengths``) padded to the longest. What the pass's
    activations scale with, so a bound on it bounds their memory."""
    return len(prompt_lengths) * max(prompt_lengths, default=0) + len(action_lengths) * max(action_lengths, default=0)


class RolloutBuffer:
    """Storage for T steps of N envs with A agents; actions up to L tokens.

    Filled by ``add`` (one call per env step, for the (env, agent) pairs that acted) and ``add_step_results`` (what
    the env paid for them, once per env step). Collection also
    writes ``next_values`` [T, N, A], the value to bootstrap from after each action (0 where the
    episode ended, terminated or truncated), and before the update ``ref_log_probs`` / ``token_rewards`` where the
    algorithm reads them, and with rollout correction ``old_log_probs`` (the trainer's scores of the
    actions before the update, which the ratio is then taken against) and ``rollout_weights``.
    """

    def __init__(self, num_steps: int, num_envs: int, num_agents: int, max_action_tokens: int,
                 device: torch.device | str = "cpu", token_values: bool = False):
        self.shape = (num_steps, num_envs, num_agents)
        self.max_action_tokens = max_action_tokens
        self.device = torch.device(device)
        slots = dict(device=self.device)
        tokens = (*self.shape, max_action_tokens)
        self.action_ids = torch.zeros(tokens, dtype=torch.long, **slots)
        self.action_lengths = torch.zeros(self.shape, dtype=torch.long, **slots)
        self.rollout_log_probs = torch.zeros(tokens, **slots)
        self.values = torch.zeros(self.shape, **slots)  # V(s_t), action-level critic
        self.token_values = torch.zeros(tokens, **slots) if token_values else None  # V_{t,j}, token critic
        self.next_values = torch.zeros(self.shape, **slots)
        self.rewards = torch.zeros(self.shape, **slots)
        self.token_rewards: torch.Tensor | None = None  # [T, N, A, L] per-token rewards (implicit PRM)
        self.ref_log_probs: torch.Tensor | None = None  # [T, N, A, L]
        self.old_log_probs: torch.Tensor | None = None  # [T, N, A, L] the trainer's (None: the sampler's are)
        self.rollout_weights: torch.Tensor | None = None  # [T, N, A, L] or [T, N, A, 1] rollout correction
        self.cut = torch.zeros(self.shape, dtype=torch.bool, **slots)  # the action stopped at max_action_tokens
        self.terminated = torch.zeros(self.shape, dtype=torch.bool, **slots)
        self.truncated = torch.zeros(self.shape, dtype=torch.bool, **slots)
        self.live = torch.zeros(self.shape, dtype=torch.bool, **slots)
        self.correct = torch.full(self.shape, float("nan"), **slots)  # verdict where an episode ended
        self.group_ids = torch.zeros(self.shape, dtype=torch.long, **slots)
        self.prompt_ids: list[list[int] | None] = [None] * self.num_slots
        self.critic_prompt_ids: list[list[int] | None] | None = None  # a centralized critic's input, when it has one
        self.texts: list[str | None] = [None] * self.num_slots
        self.steps_filled = 0

    @property
    def num_slots(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def slot_index(self, step: int, envs: torch.Tensor, agents: torch.Tensor) -> torch.Tensor:
        """Flat indices [B] of (step, envs[b], agents[b])."""
        _, num_envs, num_agents = self.shape
        return step * num_envs * num_agents + envs * num_agents + agents

    def add(self, record: StepRecord) -> None:
        """Records the actions of ``record`` (one env step's trained (env, agent) pairs); what the env paid for
        them comes after, through ``add_step_results``."""
        envs = torch.as_tensor(list(record.envs), dtype=torch.long, device=self.device)
        agents = torch.as_tensor(list(record.agents), dtype=torch.long, device=self.device)
        lengths = [len(ids) for ids in record.action_ids]
        if max(lengths, default=0) > self.max_action_tokens:
            raise ValueError(f"an action has {max(lengths)} tokens; the buffer holds at most {self.max_action_tokens}")
        at = (record.step, envs, agents)
        self.action_ids[at] = _right_pad([list(a) for a in record.action_ids], self.max_action_tokens, 0, torch.long,
                                         self.device)
        self.rollout_log_probs[at] = _right_pad([list(lp) for lp in record.rollout_log_probs], self.max_action_tokens,
                                               0.0, torch.float32, self.device)
        self.action_lengths[at] = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.group_ids[at] = record.group_ids.to(self.device)
        self.live[at] = True
        if record.cut is not None:
            self.cut[at] = torch.as_tensor(list(record.cut), dtype=torch.bool, device=self.device)
        if record.values is not None:
            self.values[at] = record.values.to(self.device, torch.float32)
        if record.token_values is not None:
            padding = (0, self.max_action_tokens - record.token_values.shape[-1])
            self.token_values[at] = torch.nn.functional.pad(record.token_values, padding).to(self.device)
        flats = self.slot_index(record.step, envs, agents).tolist()
        for flat, prompt, text in zip(flats, record.prompt_ids, record.texts):
            self.prompt_ids[flat] = list(prompt)
            self.texts[flat] = text
        if record.critic_prompt_ids is not None:
            if self.critic_prompt_ids is None:
                self.critic_prompt_ids = [None] * self.num_slots
            for flat, prompt in zip(flats, record.critic_prompt_ids):
                self.critic_prompt_ids[flat] = list(prompt)
        self.steps_filled = max(self.steps_filled, record.step + 1)

    def add_step_results(self, step: int, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                         correct: np.ndarray) -> None:
        """What the env paid at ``step``: each (env, agent)'s reward [N, A] is added to its latest action in
        this rollout (the one at ``step`` if it acted then; else its last, e.g. a team outcome paid when
        another agent ended the episode), and an episode's end, terminated / truncated [N], marks it, with the
        verdict ``correct`` [N] where that is not NaN. A pair with no action in this rollout has none to take
        them."""
        steps = torch.arange(step + 1, device=self.device)[:, None, None]
        latest = torch.where(self.live[:step + 1], steps, -1).amax(0)  # [N, A]
        envs, agents = torch.nonzero(latest >= 0, as_tuple=True)
        at = (latest[envs, agents], envs, agents)
        env_index = envs.cpu().numpy()
        self.rewards[at] += torch.as_tensor(rewards[env_index, agents.cpu().numpy()], device=self.device,
                                            dtype=torch.float32)
        self.terminated[at] |= torch.as_tensor(terminated[env_index], device=self.device)
        self.truncated[at] |= torch.as_tensor(truncated[env_index], device=self.device)
        verdicts = torch.as_tensor(correct[env_index], device=self.device, dtype=torch.float32)
        self.correct[at] = torch.where(torch.isnan(verdicts), self.correct[at], verdicts)

    def add_rewards(self, step: int, envs: torch.Tensor, agents: torch.Tensor, rewards: torch.Tensor) -> None:
        """Adds ``rewards`` [B] to the actions taken at ``step`` by ``envs[b], agents[b]`` (a shaping the trainer
        pays on top of the env's reward, e.g. an overlong penalty)."""
        self.rewards[step, envs.to(self.device), agents.to(self.device)] += rewards.to(self.device, torch.float32)

    def token_mask(self) -> torch.Tensor:
        """[T, N, A, L] True on each live action's real tokens (from lengths)."""
        positions = torch.arange(self.max_action_tokens, device=self.device)
        return (positions < self.action_lengths[..., None]) & self.live[..., None]

    def episode_ends(self) -> torch.Tensor:
        """[T, N, A] True where an episode ended after the action (terminated or truncated)."""
        return self.terminated | self.truncated

    def episode_returns(self, rewards: torch.Tensor | None = None) -> torch.Tensor:
        """[N, A] summed rewards of each env's episode (episodic collection: one episode per env): the buffer's,
        or ``rewards`` [T, N, A] in their place (e.g. less a KL penalty)."""
        return ((self.rewards if rewards is None else rewards) * self.live).sum(0)

    def acted(self) -> torch.Tensor:
        """[N, A] the (env, agent) pairs that acted in their episode (episodic collection): a multi-agent
        workflow may not call on every agent."""
        return self.live.any(0)

    def turn_order(self) -> torch.Tensor:
        """[T, N, A] for each (env, agent), the steps of its actions in time order, then the steps it did
        not act at: gathering a [T, N, A, ...] tensor along T with it (``by_turns``) makes each agent's
        actions consecutive, so a recursion over "the agent's next action" (GAE in a multi-agent env,
        where other agents act in between) runs as over consecutive steps. The identity when every slot
        is live (one agent acting at every step)."""
        return torch.sort((~self.live).to(torch.int8), dim=0, stable=True).indices

    @staticmethod
    def by_turns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[T, N, A, ...] gathered along T in ``order`` (``turn_order``)."""
        index = order.reshape(*order.shape, *([1] * (x.dim() - 3))).expand_as(x)
        return x.gather(0, index)

    @staticmethod
    def from_turns(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Inverse of ``by_turns``."""
        index = order.reshape(*order.shape, *([1] * (y.dim() - 3))).expand_as(y)
        return torch.zeros_like(y).scatter_(0, index, y)

    def next_action_values(self) -> torch.Tensor:
        """[T, N, A] the value of each agent's next action in its episode (V of the state it next acts
        in), 0 after its last one: what a multi-agent env's action bootstraps from when whole episodes
        are collected (its episode ended inside the rollout, with the outcome paid as reward)."""
        order = self.turn_order()
        live, values = self.by_turns(self.live, order), self.by_turns(self.values, order)
        following = torch.cat([values[1:], torch.zeros_like(values[:1])])
        following_live = torch.cat([live[1:], torch.zeros_like(live[:1])])
        ended = self.by_turns(self.episode_ends(), order)
        return self.from_turns(torch.where(following_live & ~ended, following, 0.0), order)

    def episode_group_ids(self, per_agent: bool = True) -> torch.Tensor:
        """[N, A] the group of each (env, agent)'s episode (episodic collection). Per agent: agent a of
        prompt group g is group g * A + a, so group baselines compare one role's samples of one problem
        (with one agent, the prompt group itself); else g for every agent (a joint baseline, MAGRPO)."""
        num_agents = self.shape[2]
        group_ids = torch.where(self.live, self.group_ids, -1).amax(0)  # constant over an episode
        if not per_agent:
            return group_ids
        return group_ids * num_agents + torch.arange(num_agents, device=self.device)

    def turn_group_ids(self) -> torch.Tensor:
        """[T, N, A] the group of each action for agent- and turn-wise baselines (AT-GRPO): agent a's action at
        step t of prompt group g is group (g * A + a) * T + t, so a baseline compares one role's actions at one turn
        of one problem (whole-episode collection steps turn t of every env's episode together, at step t)."""
        num_steps = self.shape[0]
        steps = torch.arange(num_steps, device=self.device)[:, None, None]
        return self.episode_group_ids()[None] * num_steps + steps

    def episode_correct(self) -> torch.Tensor:
        """[N, A] 1.0 where the env's episode ended with a verified answer (episodic collection);
        an episode cut by the rollout length counts as not correct."""
        return torch.nan_to_num(self.correct, nan=0.0).amax(0)

    def episode_correct_at(self, index: torch.Tensor) -> torch.Tensor:
        """[B] ``episode_correct`` of the episode each flat slot of ``index`` [B] (into T * N * A) belongs to."""
        return self.episode_correct().flatten()[index % (self.shape[1] * self.shape[2])]

    def episode_token_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, mask), each [E, T * L] with E = N * A episodes (episodic collection): ``order``
        lists, for each episode, the positions of its [T * L] step-major token sequence with the
        real tokens first in time order; ``mask`` is True on those first real tokens. Together with
        ``to_episodes``/``from_episodes`` this turns a multi-step episode into one contiguous
        response (what sequence-level formulas such as ``rloo_returns`` expect), without loops."""
        per_episode = self._episode_major(self.token_mask())
        order = torch.sort((~per_episode).to(torch.int8), dim=1, stable=True).indices
        return order, per_episode.gather(1, order)

    def to_episodes(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[T, N, A, L] -> [E, T * L] in ``order``."""
        return self._episode_major(x).gather(1, order)

    def from_episodes(self, y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Inverse of ``to_episodes``: [E, T * L] -> [T, N, A, L]."""
        num_steps, num_envs, num_agents = self.shape
        flat = torch.zeros_like(y).scatter_(1, order, y)
        return flat.reshape(num_envs, num_agents, num_steps, -1).permute(2, 0, 1, 3).contiguous()

    def prompt_groups(self) -> torch.Tensor:
        """[N] the prompt group of each env's episode (episodic collection; -1 for an env that never acted)."""
        return torch.where(self.live, self.group_ids, -1).amax(0).amax(-1)

    def varied_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(group ids [G] of this buffer's prompt groups, ascending; [G] True where the episode returns of some
        agent differ within the group): DAPO's dynamic sampling keeps only these, a group of equal returns
        having zero advantage under any group baseline. Episodic collection."""
        returns, acted = self.episode_returns(), self.acted()  # [N, A]
        ids, groups = torch.unique(self.prompt_groups(), return_inverse=True)
        shape = (len(ids), returns.shape[1])
        index = groups[:, None].expand_as(returns)
        highest = returns.new_full(shape, -torch.inf).scatter_reduce(
            0, index, torch.where(acted, returns, -torch.inf), "amax")
        lowest = returns.new_full(shape, torch.inf).scatter_reduce(
            0, index, torch.where(acted, returns, torch.inf), "amin")
        return ids, (highest > lowest).any(-1)

    def episode_cut(self) -> torch.Tensor:
        """[N, A] True where an action of the agent's episode was cut at the token limit."""
        return (self.cut & self.live).any(0)

    def cut_groups(self, ids: torch.Tensor) -> torch.Tensor:
        """[G] True where prompt group ``ids`` [G] holds an action cut at the token limit (PRIME's
        ``filter_truncated`` drops these)."""
        return torch.isin(ids, self.prompt_groups()[self.episode_cut().any(-1)])

    @staticmethod
    def concat_envs(parts: Sequence[tuple[RolloutBuffer, torch.Tensor]]) -> RolloutBuffer:
        """One buffer of the envs ``index`` [n_k] of each part's buffer, part after part along N. The parts share
        steps, agents and action length; every per-slot tensor and list they hold is carried."""
        first = parts[0][0]
        num_steps, _, num_agents = first.shape
        out = RolloutBuffer(num_steps, sum(len(index) for _, index in parts), num_agents, first.max_action_tokens,
                            first.device)
        for name, value in vars(first).items():
            if isinstance(value, torch.Tensor) and value.shape[:3] == first.shape:
                setattr(out, name, torch.cat([getattr(b, name)[:, index.to(b.device)] for b, index in parts], 1))
            elif isinstance(value, list) and len(value) == first.num_slots:  # flat slot order: step, env, agent
                per_part = [b.slot_values(name, index) for b, index in parts]
                setattr(out, name, [item for t in range(num_steps) for part in per_part for item in part[t]])
        out.steps_filled = max(b.steps_filled for b, _ in parts)
        return out

    def slot_values(self, name: str, index: torch.Tensor) -> list[list]:
        """[T] lists of the per-slot list ``name``'s items of the envs ``index``, env-major within a step."""
        _, num_envs, num_agents = self.shape
        values = getattr(self, name)
        return [[values[t * num_envs * num_agents + n * num_agents + a] for n in index.tolist()
                 for a in range(num_agents)] for t in range(self.shape[0])]

    def _episode_major(self, x: torch.Tensor) -> torch.Tensor:
        num_steps, num_envs, num_agents = self.shape
        return x.permute(1, 2, 0, 3).reshape(num_envs * num_agents, num_steps * x.shape[-1])

    def update_slots(self, targets: AdvantageEstimate) -> torch.Tensor:
        """[T, N, A] the live slots ``targets`` trains on."""
        return self.live if targets.keep is None else self.live & targets.keep

    def minibatches(self, targets: AdvantageEstimate, num_mini_batch: int, micro_batches: int,
                    generator: torch.Generator | None = None,
                    skip: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    reduce_totals: Callable[[np.ndarray], np.ndarray] | None = None,
                    max_tokens: int = 0) -> Iterator[list[Batch]]:
        """Shuffles the trained slots into ``num_mini_batch`` minibatches (one optimizer step each),
        each split into up to ``micro_batches`` micro-batches (gradient accumulation), and these further
        into micro-batches of at most ``max_tokens`` forwarded tokens (``within_tokens``; 0: no limit).

        Sizes differ by at most one when the counts do not divide; every micro-batch carries its
        minibatch's sample and token totals, so each sample weighs the same. ``skip(advantages) -> [B]``,
        given the rows' advantages ([B] or [B, L]), drops rows whose loss is exactly zero before they are
        forwarded; they still count in the totals, so the gradient is unchanged.

        Data parallelism: ``reduce_totals`` maps this process's ``[num_mini_batch, 2]`` (samples, tokens)
        to the totals over every process, so a sample weighs the same whichever process holds it; every
        minibatch with rows anywhere is then yielded, as ``[]`` where this process has none to forward,
        so that all processes step together.
        """
        if num_mini_batch < 1 or micro_batches < 1:
            raise ValueError(f"num_mini_batch={num_mini_batch} and micro_batches={micro_batches} must be >= 1")
        minibatches = self.minibatch_indices(targets, num_mini_batch, generator)
        totals = self.minibatch_totals(minibatches, reduce_totals)
        for minibatch, (samples, tokens) in zip(minibatches, totals):
            if samples == 0:  # no process holds a row of it
                continue
            if skip is not None:
                minibatch = self.unskipped(minibatch, skip, targets)
            chunks = self.micro_batch_indices(minibatch, micro_batches, max_tokens)
            if chunks or reduce_totals is not None:  # all rows skipped (one process): no gradient, no step
                yield [self.batch(chunk, samples, tokens, targets) for chunk in chunks]

    def minibatch_indices(self, targets: AdvantageEstimate, num_mini_batch: int,
                          generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        """``num_mini_batch`` tensors of flat slot indices (into T * N * A): the trained slots, shuffled by one
        ``randperm`` of ``generator``, split into sizes that differ by at most one."""
        slots = self.update_slots(targets).flatten().nonzero().squeeze(1)
        order = slots[torch.randperm(len(slots), generator=generator, device="cpu").to(slots.device)]
        return torch.tensor_split(order, num_mini_batch)

    def minibatch_totals(self, minibatches: Sequence[torch.Tensor],
                         reduce_totals: Callable[[np.ndarray], np.ndarray] | None) -> list[list[int]]:
        """[M] (samples, action tokens) of each minibatch, summed over every process by ``reduce_totals``
        (None: this process alone)."""
        lengths = self.action_lengths.flatten()
        totals = np.array([(len(m), int(lengths[m].sum())) for m in minibatches], dtype=np.float64)
        if reduce_totals is not None:
            totals = reduce_totals(totals)
        return totals.astype(np.int64).tolist()

    def unskipped(self, minibatch: torch.Tensor, skip: Callable[[torch.Tensor], torch.Tensor],
                  targets: AdvantageEstimate) -> torch.Tensor:
        """The slots of ``minibatch`` [B] whose rows ``skip`` does not drop (it reads their advantages, as a
        Batch of these slots holds them)."""
        if len(minibatch) == 0:
            return minibatch
        advantages = self.slot_rows(targets.advantages, minibatch, self.row_width(minibatch))
        return minibatch[~skip(advantages).to(minibatch.device)]

    def micro_batch_indices(self, minibatch: torch.Tensor, micro_batches: int, max_tokens: int) -> list[torch.Tensor]:
        """The slots ``minibatch`` [B] cut into up to ``micro_batches`` non-empty parts of sizes that differ by at
        most one, each cut further to forward at most ``max_tokens`` tokens (``within_tokens``; 0: no limit)."""
        chunks = [chunk for chunk in torch.tensor_split(minibatch, micro_batches) if len(chunk)]
        if max_tokens:
            chunks = [part for chunk in chunks for part in self.within_tokens(chunk, max_tokens)]
        return chunks

    def within_tokens(self, index: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
        """The slots ``index`` [B] cut into micro-batches that forward at most ``max_tokens`` positions each,
        padding included, as the policy forwards rows that share a prompt: each distinct prompt once, padded to
        the longest of them, then every row's action, padded to the longest action (``forwarded_positions``).
        The rows of one prompt form a group, taken in the order the prompts first appear: a group that does not
        fit beside the rows before it starts a micro-batch, and one that alone exceeds the budget is cut across
        micro-batches, each paying its prompt again; a row longer than the budget is a micro-batch of its own."""
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for slot, length in zip(index.tolist(), self.action_lengths.flatten()[index].tolist()):
            groups.setdefault(tuple(self.prompt_ids[slot]), []).append((slot, length))
        parts: list[list[int]] = [[]]
        prompts: list[int] = []  # the prompt lengths of parts[-1]
        actions: list[int] = []  # its action lengths
        for prompt, rows in groups.items():
            lengths = [length for _, length in rows]
            if parts[-1] and forwarded_positions([*prompts, len(prompt)], [*actions, *lengths]) > max_tokens:
                parts.append([])
                prompts, actions = [], []
            prompts.append(len(prompt))
            for slot, length in rows:
                if parts[-1] and forwarded_positions(prompts, [*actions, length]) > max_tokens:
                    parts.append([])
                    prompts, actions = [len(prompt)], []
                parts[-1].append(slot)
                actions.append(length)
        return [torch.tensor(part, dtype=index.dtype, device=index.device) for part in parts]

    def batch(self, index: torch.Tensor, minibatch_samples: int, minibatch_tokens: int,
              targets: AdvantageEstimate | None = None) -> Batch:
        """The slots ``index`` [B] as a Batch, actions trimmed to their longest length; advantages and
        returns from ``targets`` (None without)."""
        lengths = self.action_lengths.flatten()[index]
        width = self.row_width(index)

        def tokens(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else self.token_rows(x, index, width)

        def per_slot(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else self.slot_rows(x, index, width)

        token_mask = torch.arange(width, device=self.device) < lengths[:, None]
        old_values = tokens(self.token_values) if self.token_values is not None else per_slot(self.values)
        return Batch(
            index=index,
            agents=index % self.shape[2],
            prompt_ids=[self.prompt_ids[i] for i in index.tolist()],
            critic_prompt_ids=(None if self.critic_prompt_ids is None
                            else [self.critic_prompt_ids[i] for i in index.tolist()]),
            action_ids=tokens(self.action_ids),
            action_lengths=lengths,
            token_mask=token_mask,
            old_log_probs=tokens(self.rollout_log_probs if self.old_log_probs is None else self.old_log_probs),
            old_values=old_values,
            ref_log_probs=tokens(self.ref_log_probs),
            advantages=per_slot(targets.advantages) if targets is not None else None,
            returns=per_slot(targets.returns) if targets is not None else None,
            num_samples=len(index),
            num_tokens=int(lengths.sum()),
            minibatch_samples=minibatch_samples,
            minibatch_tokens=max(minibatch_tokens, 1),
            rollout_weights=tokens(self.rollout_weights),
        )

    def row_width(self, index: torch.Tensor) -> int:
        """The token width of the rows of the slots ``index`` [B]: their longest action (at least 1)."""
        lengths = self.action_lengths.flatten()[index]
        return max(int(lengths.max()) if len(index) else 1, 1)

    def token_rows(self, x: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] the per-token tensor ``x`` [T, N, A, L] at the slots ``index`` [B]."""
        return x.reshape(self.num_slots, -1)[index, :width]

    def slot_rows(self, x: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
        """``x`` at the slots ``index`` [B]: [B] of a per-action tensor [T, N, A], [B, width] of a per-token one."""
        return x.flatten()[index] if x.dim() == 3 else self.token_rows(x, index, width)

    def rows(self, slots: torch.Tensor | None = None) -> Batch:
        """The slots where ``slots`` [T, N, A] (default: every live slot) is True, as one Batch without
        targets (for forward passes over the whole rollout: reference log-probs, implicit-PRM rewards)."""
        index = (self.live if slots is None else slots).flatten().nonzero().squeeze(1)
        return self.batch(index, len(index), int(self.action_lengths.flatten()[index].sum()))

    def scatter_tokens(self, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[T, N, A, L] zeros with ``values`` [B, L'] written at the slots ``index`` [B]."""
        out = torch.zeros(self.num_slots, self.max_action_tokens, device=self.device)
        out[index, :values.shape[1]] = values.to(self.device, torch.float32)
        return out.reshape(*self.shape, self.max_action_tokens)


def _right_pad(rows: list[list], width: int, fill, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[B, width] tensor of rows padded with ``fill`` on the right."""
    out = torch.full((len(rows), width), fill, dtype=dtype, device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    mask = torch.arange(width, device=device)[None] < lengths[:, None]
    out[mask] = torch.tensor([x for r in rows for x in r], dtype=dtype, device=device)
    return out
