"""Held-out evaluation: greedy solutions to a fixed list of problems, graded by the env.

The eval env is a vector env over held-out problems with one env per problem of a batch (group size
1, no autoreset); each batch is reset to the next ``num_envs`` problem ids and stepped until every
episode ended, generating only for the episodes still going (in a multi-agent env: for the agents
that act; the solution length counts every agent's tokens, the verdict is the team's final answer, and
each role's verified outputs are averaged as ``eval/<role>/<metric>``: its answers' accuracy, a judge's
acceptance rate and verdict accuracy). Under data parallelism each rank solves every world_size-th
problem and the sums are added over ranks.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from envs.contract import FACTS
from envs.multi_agent import ROLE_METRICS
from train import distributed
from train.collector import Sampling, Voices, acting_pairs, pair_actions, pair_prompts
from train.distributed import Ranks
from models.generation import Generator


@torch.no_grad()
def evaluate(env, generator: Generator, sampling: Sampling, limit: int, ranks: Ranks = Ranks(),
             voices: Voices = Voices(), verdict: str = "correct") -> dict[str, float]:
    """Greedy accuracy, mean solution length in tokens and, when the env pays a PRM reward, the mean
    PRM score, over the first ``limit`` of ``env.problems`` (this rank's share of them, then summed).
    ``voices``: who speaks for each agent of a multi-agent env (the policy's role adapters, frozen roles'
    own models). ``verdict``: what an ended episode's verdict is: "correct" (the verified answer) or a
    reward source's name ("target": the frozen target's, finishing the policy's prefix)."""
    started = time.perf_counter()
    problem_ids = [p.id for p in env.problems][:limit][ranks.rank::ranks.world_size]
    roles = env.agents.roles
    correct, lengths, prm_scores = [], [], []
    role_sums = np.zeros((2, len(roles), len(ROLE_METRICS)))  # (sum, count) of each role's metrics
    for start in range(0, len(problem_ids), env.num_envs):
        batch_correct, batch_lengths, batch_prm = solve_batch(env, generator, sampling,
                                                              problem_ids[start:start + env.num_envs],
                                                              voices, role_sums, verdict)
        correct += batch_correct
        lengths += batch_lengths
        prm_scores += batch_prm
    prm_scores = np.asarray(prm_scores, dtype=np.float64)
    scored = prm_scores[~np.isnan(prm_scores)]
    sums = distributed.all_reduce_sum([sum(correct), sum(lengths), len(correct), scored.sum(), len(scored),
                                       *role_sums.flatten().tolist()])
    result = {"eval/accuracy": sums[0] / sums[2], "eval/mean_length": sums[1] / sums[2],
              "time/eval": time.perf_counter() - started}
    if sums[4]:
        result["eval/prm_score"] = sums[3] / sums[4]
    role_sums = np.asarray(sums[5:]).reshape(role_sums.shape)
    for a, role in enumerate(roles):
        for m, metric in enumerate(ROLE_METRICS):
            if role_sums[1, a, m]:
                result[f"eval/{role}/{metric}"] = role_sums[0, a, m] / role_sums[1, a, m]
    return {key: float(value) for key, value in result.items()}


def solve_batch(env, generator: Generator, sampling: Sampling, problem_ids: Sequence[str], voices: Voices,
                role_sums: np.ndarray, verdict: str = "correct") -> tuple[list[float], list[float], list[float]]:
    """(verdicts (``verdict`` as in ``evaluate``), solution lengths in tokens) of the problems ``problem_ids`` (at most
    ``env.num_envs``), and the PRM scores of every step taken; adds each role's verified outputs into
    ``role_sums`` [2 (sum, count), A, len(ROLE_METRICS)] (multi-agent envs)."""
    count = len(problem_ids)
    padded = list(problem_ids) + [problem_ids[0]] * (env.num_envs - count)  # the env has a fixed size; extras ignored
    obs, info = env.reset(options={"problem_ids": padded})
    done = np.zeros(env.num_envs, dtype=bool)
    done[count:] = True
    tokens, verdicts, prm_scores = np.zeros(env.num_envs), np.zeros(env.num_envs), []
    while not done.all():
        envs, agents = acting_pairs(info[FACTS], done)
        out = voices.generate(sampling, generator, pair_prompts(env.agents, obs, envs, agents), agents, greedy=True)
        obs, _, terminated, truncated, info = env.step(pair_actions(env, sampling, out, envs, agents))
        facts = info[FACTS]
        np.add.at(tokens, envs, [len(ids) for ids in out.token_ids])
        ended = (terminated | truncated) & ~done
        verdicts[ended] = np.nan_to_num(facts.correct if verdict == "correct" else facts.sources[verdict][:, 0])[ended]
        if "prm" in facts.sources:  # [N, A]; NaN where an action was not scored
            prm_scores += facts.sources["prm"][envs, agents].tolist()
        for m, metric in enumerate(ROLE_METRICS):
            if metric in facts.outputs:
                # [N, A], NaN where the slot said none; not the envs whose episode had ended, or that only pad the batch
                values = facts.outputs[metric][~done]
                role_sums[0, :, m] += np.nansum(values, axis=0)
                role_sums[1, :, m] += (~np.isnan(values)).sum(0)
        done |= terminated | truncated
    return verdicts[:count].tolist(), tokens[:count].tolist(), prm_scores
