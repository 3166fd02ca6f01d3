"""Each iteration's batch: collected now (synchronous), or collected in a background thread by a copy of
the policy while the previous batch trains (asynchronous), and the statistics logged about it.

Asynchronous: the copy is refreshed so that no batch lags more than ``max_policy_lag`` policy versions;
ratios use the rollout log-probs recorded at generation time. Under bfloat16 the copy holds bfloat16
weights (the trainer's fp32 master weights rounded at each refresh): its log-probs are those of the
distribution it sampled from, which the ratio corrects for as for any other sampler (vLLM's). What the
trainer has been handed is "handed over": a checkpoint or a logged count of env steps never includes the batch
still in flight, so a resume collects that batch again from the env state it started from.

Dynamic sampling (DAPO, Yu et al. 2025, section 3.2; verl's ``filter_groups``): a batch is collected in rounds
of fresh prompt groups, each rank keeping its groups whose episode returns are not all equal (a group of equal
returns has zero advantage), until it holds as many groups as one round draws, or ``max_num_gen_batches``
rounds were drawn; then it trains on the groups it holds (a round's whole batch if it kept none). With PRIME's
``filter_truncated`` a group holding an answer cut at the token limit is not kept either. Each rank fills its own
share (no collective: ranks stay free to draw different numbers of rounds, in the background thread too). The
rounds after the first are their own cost, logged as ``time/refill``.

From ``Runner.train_iteration`` to the generation backend: ``Rollouts.next`` -> ``Collector.collect`` ->
``episodes.play`` -> ``Generator.generate`` (one call per speaker at each env step); with dynamic sampling
``Rollouts.next`` -> ``refilled`` -> ``Collector.collect`` -> ``episodes.play`` -> ``Generator.generate``.
Asynchronously the background thread runs the same ``Collector.collect`` (or ``refilled``) that
``Rollouts.next`` submits.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from algorithms.buffer import RolloutBuffer
from models.generation import Generator, mix_seed
from models.policy import LanguagePolicy
from train import distributed
from train.collector import COUNTS, Collector, Tally
from train.distributed import Ranks


def refilled(collect: Callable[[LanguagePolicy, Generator, int], tuple[RolloutBuffer, Tally]], policy: LanguagePolicy,
             generator: Generator, seed: int, groups_wanted: int, max_rounds: int,
             filter_truncated: bool = False) -> tuple[RolloutBuffer, Tally]:
    """Dynamic sampling: rounds ``collect(policy, generator, round_seed)`` (``Collector.collect``; the first round
    at ``seed``) until their groups of varied returns number ``groups_wanted``, at most ``max_rounds``; with
    ``filter_truncated`` a group holding an action cut at the token limit is not kept either. Returns the batch
    of those groups (the first ones kept, in round order) and the rounds' statistics: every episode drawn,
    ``rollout/gen_rounds``, ``rollout/filtered_share`` (drawn groups not kept), ``rollout/cut_group_share``
    (with ``filter_truncated``: drawn groups holding a cut action) and ``rollout/filled_share`` (the batch's
    groups over ``groups_wanted``); the seconds of the rounds after the first under ``refill_<phase>``."""
    parts, tally, kept, drawn, filtered, cut = [], Tally(), 0, 0, 0, 0
    for round_ in range(max_rounds):
        buffer, round_tally = collect(policy, generator, seed if round_ == 0 else mix_seed(seed, round_))
        tally.merge(round_tally, seconds_prefix="refill_" if round_ else "")
        ids, usable = buffer.varied_groups()
        if filter_truncated:
            cut_groups = buffer.cut_groups(ids)
            cut += int(cut_groups.sum())
            usable &= ~cut_groups
        drawn, filtered = drawn + len(ids), filtered + int((~usable).sum())
        taken = ids[usable][: groups_wanted - kept]
        kept += len(taken)
        parts.append((buffer, torch.isin(buffer.prompt_groups(), taken).nonzero().squeeze(1)))
        if kept >= groups_wanted:
            break
    tally.add("rollout/gen_rounds", [round_ + 1])
    tally.add("rollout/filtered_share", [1.0] * filtered + [0.0] * (drawn - filtered))
    if filter_truncated:
        tally.add("rollout/cut_group_share", [1.0] * cut + [0.0] * (drawn - cut))
    tally.add("rollout/filled_share", [1.0] * kept + [0.0] * (groups_wanted - kept))
    if kept == 0:  # nothing to learn from: the last round as it came (RLOO's filter drops its cut groups)
        return buffer, tally
    return RolloutBuffer.concat_envs([(part, index) for part, index in parts if len(index)]), tally


@dataclass(frozen=True)
class Collected:
    """An iteration's batch (``buffer``), its logged ``stats``, and whether the asynchronous rollout copy was
    ``refreshed`` to the policy's current version on the way (``Rollouts.next``)."""

    buffer: RolloutBuffer
    stats: dict[str, float]
    refreshed: bool = False


class Rollouts:
    """``rollout_policy``/``rollout_generator``: the copy asynchronous collection uses (None: synchronous).
    ``max_num_gen_batches``: dynamic sampling's most rounds per batch (None: one collection, unfiltered);
    ``filter_truncated``: dynamic sampling also drops groups holding a cut action."""

    def __init__(self, collector: Collector, policy: LanguagePolicy, generator: Generator, seed: int,
                 num_iterations: int, max_policy_lag: int, ranks: Ranks,
                 rollout_policy: LanguagePolicy | None = None, rollout_generator: Generator | None = None,
                 max_num_gen_batches: int | None = None, filter_truncated: bool = False):
        self.collector, self.policy, self.generator = collector, policy, generator
        self.seed, self.num_iterations, self.max_policy_lag, self.ranks = seed, num_iterations, max_policy_lag, ranks
        self.rollout_policy, self.rollout_generator = rollout_policy, rollout_generator
        # collect(policy, generator, seed) -> one batch: a collection, or the rounds of them that fill it
        env = collector.env
        self.collect = collector.collect if max_num_gen_batches is None else functools.partial(
            refilled, collector.collect, groups_wanted=env.num_envs // env.group_size, max_rounds=max_num_gen_batches,
            filter_truncated=filter_truncated)
        asynchronous = rollout_policy is not None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if asynchronous else None
        self.pending: concurrent.futures.Future | None = None
        self.pending_version = 0  # the rollout copy's version when the pending batch was started
        self.pending_start: dict[str, Any] | None = None  # the collector's state before the pending batch

    def iteration_seed(self, iteration: int) -> int:
        return self.seed * 1_000_003 + iteration * 1_009

    def next(self, iteration: int, version: int, rollout_version: int) -> Collected:
        """This iteration's batch and its statistics: collected now, or (async) the one collected in the
        background, after starting the next one with a policy copy at most ``max_policy_lag`` versions old.
        ``version``: the policy's (optimizer updates so far); ``rollout_version``: the rollout copy's."""
        seed = self.iteration_seed(iteration)
        if self.pool is None:
            with self.policy.gathered():
                buffer, tally = self.collect(self.policy, self.generator, seed)
            return Collected(buffer, self.statistics(tally))
        if self.pending is not None:
            (buffer, tally), sampled_at = self.pending.result(), self.pending_version
        else:
            buffer, tally = self.collect(self.rollout_policy, self.rollout_generator, seed)
            sampled_at = rollout_version
        stats = {**self.statistics(tally), "train/policy_lag": float(version - sampled_at)}
        # The next batch is trained on after this iteration's update, at version + 1.
        refreshed = version + 1 - rollout_version > self.max_policy_lag
        if refreshed:
            self.refresh()
        self.pending_version = version if refreshed else rollout_version
        self.pending, self.pending_start = None, None
        if iteration + 1 < self.num_iterations:  # no batch beyond the budget: every env step taken is trained on
            self.pending_start = copy.deepcopy(self.collector.get_state())  # the thread changes its lists
            self.pending = self.pool.submit(self.collect, self.rollout_policy, self.rollout_generator, seed + 1)
        return Collected(buffer, stats, refreshed)

    def refresh(self) -> None:
        """The background rollouts' copy takes the policy's current weights (every rank together)."""
        self.rollout_policy.load_state_dict(self.policy.whole_state_dict())
        self.rollout_generator.sync(self.rollout_policy)

    def wait(self) -> None:
        """Returns once no batch is in flight (the env and its reward models are free); a failed batch
        raises where its result is taken (``next``)."""
        if self.pending is not None:
            concurrent.futures.wait([self.pending])

    def handed_over_state(self) -> dict[str, Any]:
        """The collector's state (``Collector.get_state``) after the batches handed to the trainer: before
        the batch in flight, if one is."""
        return self.pending_start if self.pending is not None else self.collector.get_state()

    def counts(self) -> dict[str, int]:
        """{name: count} of the collector's ``COUNTS`` over the batches handed to the trainer, by every rank
        together."""
        state = self.handed_over_state()
        totals = distributed.all_reduce_sum([state[name] for name in COUNTS])
        return {name: int(total) for name, total in zip(COUNTS, totals)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def statistics(self, tally: Tally) -> dict[str, float]:
        """The rollout's logged statistics: means of the collector's sums and counts, added over ranks
        first (times: the slowest rank's)."""
        if self.ranks.distributed:
            tally = reduced_tally(tally)
        step_reward = tally.mean("train/step_reward")
        # train/reward/<source> (the reward model's parts), train/<role>/<metric> and train/<role>/reward/<source>
        # (multi-agent envs), and train/tool_calls (the share of actions that called an env's tool)
        means = {key: tally.mean(key) for key in tally.sums
                 if (key.startswith("train/") and (key.count("/") >= 2 or key == "train/tool_calls"))
                 or key.startswith("rollout/")}
        generate_seconds = tally.seconds["generate"] + tally.seconds.get("refill_generate", 0.0)
        refill = {"time/refill": tally.seconds["refill_generate"] + tally.seconds["refill_reward"]
                  } if "refill_generate" in tally.seconds else {}
        return {
            "time/generate": tally.seconds["generate"], "time/reward": tally.seconds["reward"], **refill,
            "perf/tokens_per_second": tally.sums["tokens"] / max(generate_seconds, 1e-9),
            "train/step_reward": step_reward,
            # mean return of the episodes that ended in this rollout (every episode, when episodic)
            "train/reward": tally.mean("train/reward") if tally.counts["train/reward"] else step_reward,
            "train/accuracy": tally.mean("train/accuracy"),
            "train/episodes": float(tally.counts["train/reward"]),
            "train/action_tokens": tally.mean("train/action_tokens"),
            **means,
        }


def reduced_tally(tally: Tally) -> Tally:
    """Sums and counts added over ranks, seconds the slowest rank's."""
    total = Tally()
    sums, counts = distributed.sum_by_key(tally.sums, tally.counts)
    total.sums.update(sums)
    total.counts.update({key: int(count) for key, count in counts.items()})
    gathered = distributed.all_gather_objects(dict(tally.seconds))
    for name in set().union(*gathered):
        total.seconds[name] = max(rank_seconds.get(name, 0.0) for rank_seconds in gathered)
    return total
