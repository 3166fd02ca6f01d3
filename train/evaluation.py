"""Held-out evaluation: greedy solutions to a fixed list of problems, graded by the env, and (with
``EvalSampling.samples`` = n > 0) n sampled ones per problem, reported as papers do: pass@k, maj@k and
mean@n (``train.eval_metrics``). Several held-out sets are evaluated one after the other, each logged
under its own name (``evaluate_sets``).

The eval env is a vector env over held-out problems with one env per problem of a batch (group size
1, no autoreset); each batch is reset to the next ``num_envs`` problem ids and played by the training
collector's loop (``train.episodes.play``), without a buffer, until every episode ended, generating only
for the episodes still going (in a multi-agent env: for the agents
that act; the solution length counts every agent's tokens, the verdict is the team's final answer, and
each role's verified outputs are averaged as ``eval/<role>/<metric>``: its answers' accuracy, a judge's
acceptance rate and verdict accuracy). The n samples of a problem are n rows of the same batches (one
generate call per env step for all of them), each drawn from a seed of (``EvalSampling.seed``, the
problem's index in the held-out list, the sample's index), so they are the same at every evaluation
(checkpoints are compared on common random numbers) and however problems are batched or split over
ranks. Under data parallelism each rank solves every world_size-th problem and the sums are added over
ranks.

Besides accuracy, ``readable`` is the share of greedy solutions whose final answer the grader could
extract and ``accuracy_readable`` the accuracy among those: format failures apart from wrong answers. A set
whose problems carry more than one level (MATH's 1-5, Arith's number of operations) also logs the greedy
accuracy of each as ``accuracy_level_<level>``: a mean over levels can hide a gain on one and a loss on another.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from envs.contract import FACTS, StepFacts
from envs.multi_agent import ROLE_METRICS
from models.generation import Generator, mix_seed
from train import distributed
from train.distributed import Ranks
from train.episodes import RoleModels, Sampling, play
from train.eval_metrics import sampled_sums


@dataclass(frozen=True)
class EvalSampling:
    """``samples`` sampled solutions per held-out problem besides the greedy one (0: none), drawn at
    ``temperature`` and ``top_p`` from seeds of ``seed`` (see the module docstring)."""

    samples: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Solved:
    """Per row of a list of episodes: the verdict, the solution's length in tokens, the final answer the env
    judged (None where it read none); and per step taken its PRM score (NaN where none) and, in an env with a
    tool, whether it called the tool (1.0 or 0.0)."""

    verdicts: list[float] = dataclasses.field(default_factory=list)
    lengths: list[float] = dataclasses.field(default_factory=list)
    answers: list[str | None] = dataclasses.field(default_factory=list)
    prm_scores: list[float] = dataclasses.field(default_factory=list)
    tool_calls: list[float] = dataclasses.field(default_factory=list)

    def extend(self, other: Solved) -> None:
        for name in ("verdicts", "lengths", "answers", "prm_scores", "tool_calls"):
            getattr(self, name).extend(getattr(other, name))


def evaluate_sets(envs: dict[str | None, Any], generator: Generator, sampling: Sampling, limit: int,
                  ranks: Ranks = Ranks(), role_models: RoleModels = RoleModels(), verdict: str = "correct",
                  sampled: EvalSampling = EvalSampling()) -> dict[str, float]:
    """``evaluate`` on each held-out set of ``envs`` {name: its eval env}: the unnamed one (None) under
    ``eval/``, a named one under ``eval/<name>/``. ``eval/accuracy`` is the first set's greedy accuracy
    either way (the headline, which the best checkpoint follows); ``time/eval`` the time all took."""
    result, seconds = {}, 0.0
    for name, env in envs.items():
        one = evaluate(env, generator, sampling, limit, ranks, role_models, verdict, sampled,
                       prefix="eval/" if name is None else f"eval/{name}/")
        seconds += one.pop("time/eval")
        result.update(one)
    first = next(iter(envs))
    headline = {} if first is None else {"eval/accuracy": result[f"eval/{first}/accuracy"]}
    return {**headline, **result, "time/eval": seconds}


@torch.no_grad()
def evaluate(env, generator: Generator, sampling: Sampling, limit: int, ranks: Ranks = Ranks(),
             role_models: RoleModels = RoleModels(), verdict: str = "correct", sampled: EvalSampling = EvalSampling(),
             prefix: str = "eval/") -> dict[str, float]:
    """Greedy accuracy, ``readable`` and ``accuracy_readable`` (verdict "correct"), mean solution length in
    tokens and, when the env pays a PRM reward, the mean PRM score, over the first ``limit`` of
    ``env.problems`` (this rank's share of them, then summed); with ``sampled.samples`` also pass@k, maj@k
    (verdict "correct") and mean@n of the samples. Keys start with ``prefix``, but ``time/eval``.
    ``role_models``: who speaks for each agent of a multi-agent env (the policy's role adapters, frozen roles'
    own models). ``verdict``: what an ended episode's verdict is: "correct" (the verified answer) or a
    reward source's name ("target": the frozen target's, finishing the policy's prefix)."""
    started = time.perf_counter()
    indices = list(range(min(limit, len(env.problems))))[ranks.rank::ranks.world_size]
    problem_ids = [env.problems[i].id for i in indices]
    roles = env.agents.roles
    role_sums = np.zeros((2, len(roles), len(ROLE_METRICS)))  # (sum, count) of each role's metrics
    greedy = solve(env, generator, sampling, problem_ids, role_models, verdict, role_sums)
    result = greedy_metrics(greedy, role_sums, roles, verdict == "correct")
    result.update(level_accuracies(greedy.verdicts, [env.problems[i].level for i in indices],
                                   [problem.level for problem in env.problems[:limit]]))
    if sampled.samples:
        result.update(sampled_metrics(env, generator, sampling, indices, role_models, verdict, sampled))
    return {**{prefix + key: float(value) for key, value in result.items()}, "time/eval": time.perf_counter() - started}


def greedy_metrics(greedy: Solved, role_sums: np.ndarray, roles: Sequence[str], answers: bool) -> dict[str, float]:
    """The greedy solutions' means over every rank (``evaluate``); ``answers``: whether the verdicts judged the
    answers read (``readable``, ``accuracy_readable``)."""
    prm_scores = np.asarray(greedy.prm_scores, dtype=np.float64)
    scored = prm_scores[~np.isnan(prm_scores)]
    readable = np.array([answer is not None for answer in greedy.answers], dtype=bool)
    verdicts = np.asarray(greedy.verdicts, dtype=np.float64)
    totals = {"correct": verdicts.sum(), "tokens": sum(greedy.lengths), "solutions": len(verdicts),
              "prm_score": scored.sum(), "prm_steps": len(scored), "readable": readable.sum(),
              "readable_correct": verdicts[readable].sum(), "tool_calls": sum(greedy.tool_calls),
              "tool_steps": len(greedy.tool_calls)}
    reduced = distributed.all_reduce_sum([*totals.values(), *role_sums.flatten().tolist()])
    sums = dict(zip(totals, reduced))
    result = {"accuracy": sums["correct"] / sums["solutions"], "mean_length": sums["tokens"] / sums["solutions"]}
    if sums["prm_steps"]:
        result["prm_score"] = sums["prm_score"] / sums["prm_steps"]
    if answers:
        result["readable"] = sums["readable"] / sums["solutions"]
        if sums["readable"]:
            result["accuracy_readable"] = sums["readable_correct"] / sums["readable"]
    if sums["tool_steps"]:  # an env with a tool: the share of steps that called it, as train/tool_calls
        result["tool_calls"] = sums["tool_calls"] / sums["tool_steps"]
    role_sums = reduced[len(totals):].reshape(role_sums.shape)
    for a, role in enumerate(roles):
        for m, metric in enumerate(ROLE_METRICS):
            if role_sums[1, a, m]:
                result[f"{role}/{metric}"] = role_sums[0, a, m] / role_sums[1, a, m]
    return result


def level_accuracies(verdicts: Sequence[float], row_levels: Sequence[int | None],
                     all_levels: Sequence[int | None]) -> dict[str, float]:
    """``accuracy_level_<L>``: the mean verdict of the rows of each level L (``row_levels``, this rank's rows),
    summed over every rank; the levels are those of ``all_levels`` (every rank's problems, so that every rank
    reduces the same list). Empty where the problems hold fewer than two levels."""
    levels = sorted({level for level in all_levels if level is not None})
    if len(levels) < 2:
        return {}
    by_row = np.asarray([-1 if level is None else level for level in row_levels])
    verdicts = np.asarray(verdicts, dtype=np.float64)
    sums = [verdicts[by_row == level].sum() for level in levels] + [(by_row == level).sum() for level in levels]
    reduced = distributed.all_reduce_sum(sums)
    return {f"accuracy_level_{level}": reduced[i] / reduced[len(levels) + i]
            for i, level in enumerate(levels) if reduced[len(levels) + i]}


def sampled_metrics(env, generator: Generator, sampling: Sampling, indices: Sequence[int], role_models: RoleModels,
                    verdict: str, sampled: EvalSampling) -> dict[str, float]:
    """pass@k, maj@k (verdict "correct": the answers are what was judged) and mean@n of ``sampled.samples``
    solutions to each problem ``indices`` (positions in ``env.problems``), means over every rank."""
    n = sampled.samples
    rows = [env.problems[i].id for i in indices for _ in range(n)]
    seeds = [mix_seed(sampled.seed, i, j) for i in indices for j in range(n)]
    drawn = dataclasses.replace(sampling, temperature=sampled.temperature, top_p=sampled.top_p)
    solved = solve(env, generator, drawn, rows, role_models, verdict, seeds=seeds)
    correct = np.asarray(solved.verdicts, dtype=np.float64).reshape(len(indices), n)
    answers = [solved.answers[p * n:(p + 1) * n] for p in range(len(indices))] if verdict == "correct" else None
    sums = sampled_sums(correct, answers)
    totals = distributed.all_reduce_sum([*sums.values(), len(indices)])
    return {key: total / totals[-1] for key, total in zip(sums, totals)}


def solve(env, generator: Generator, sampling: Sampling, problem_ids: Sequence[str], role_models: RoleModels,
          verdict: str = "correct", role_sums: np.ndarray | None = None, seeds: Sequence[int] | None = None) -> Solved:
    """``solve_batch`` over ``problem_ids`` (one row each, a problem may repeat), ``env.num_envs`` at a time."""
    solved = Solved()
    for start in range(0, len(problem_ids), env.num_envs):
        end = start + env.num_envs
        solved.extend(solve_batch(env, generator, sampling, problem_ids[start:end], role_models, role_sums, verdict,
                                  None if seeds is None else seeds[start:end]))
    return solved


def solve_batch(env, generator: Generator, sampling: Sampling, problem_ids: Sequence[str], role_models: RoleModels,
                role_sums: np.ndarray | None = None, verdict: str = "correct",
                seeds: Sequence[int] | None = None) -> Solved:
    """The episodes of the problems ``problem_ids`` (at most ``env.num_envs``), played by ``train.episodes.play``:
    greedy, or sampled with row b's action at env step t by agent a drawn from ``mix_seed(seeds[b], t, a)``.
    Verdicts as ``verdict`` says (see ``evaluate``); adds each role's verified outputs into ``role_sums``
    [2 (sum, count), A, len(ROLE_METRICS)] (multi-agent envs), when given."""
    count = len(problem_ids)
    padded = list(problem_ids) + [problem_ids[0]] * (env.num_envs - count)  # the env has a fixed size; extras ignored
    obs, info = env.reset(options={"problem_ids": padded})
    tokens, verdicts, prm_scores, tool_calls = np.zeros(env.num_envs), np.zeros(env.num_envs), [], []
    answers = np.full(env.num_envs, None, dtype=object)

    def seed_of(step: int, row: int, agent: int) -> int:
        return mix_seed(seeds[row], step, int(agent))

    for stepped in play(env, obs, info[FACTS], generator, sampling, role_models, None if seeds is None else seed_of,
                        in_play=np.arange(env.num_envs) < count):
        facts, envs, agents, ended = stepped.facts, stepped.envs, stepped.agents, stepped.ended
        np.add.at(tokens, envs, [len(ids) for ids in stepped.out.token_ids])
        verdicts[ended] = np.nan_to_num(facts.correct if verdict == "correct" else facts.sources[verdict][:, 0])[ended]
        answers[ended] = facts.answers[ended]
        if "prm" in facts.sources:  # [N, A]; NaN where an action was not scored
            prm_scores += facts.sources["prm"][envs, agents].tolist()
        if facts.tool_called is not None:  # an env with a tool
            tool_calls += facts.tool_called[envs, agents].astype(float).tolist()
        if role_sums is not None:
            add_role_outputs(role_sums, facts, stepped.in_play)
    return Solved(verdicts[:count].tolist(), tokens[:count].tolist(), answers[:count].tolist(), prm_scores,
                  tool_calls)


def add_role_outputs(role_sums: np.ndarray, facts: StepFacts, in_play: np.ndarray) -> None:
    """Adds each role's verified outputs of this step (``facts.outputs``) of the envs ``in_play`` [N] into
    ``role_sums`` (not those whose episode had ended, or that only pad the batch)."""
    for m, metric in enumerate(ROLE_METRICS):
        if metric in facts.outputs:
            values = facts.outputs[metric][in_play]  # [N', A], NaN where the slot said none
            role_sums[0, :, m] += np.nansum(values, axis=0)
            role_sums[1, :, m] += (~np.isnan(values)).sum(0)
