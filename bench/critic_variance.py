"""How much of the return's variance a centralized critic explains, against per-role critics, on the same
rollouts of a workflow in which one role needs another's information.

    python bench/critic_variance.py [--policy DIR] [--train_episodes 512] [--test_episodes 256]
                                    [--alpha 100] [--seeds 0 1 2]

The workflow, "solver and reporter": a solver answers the problem, then a reporter acts, whose prompt is
its instruction alone: it sees neither the problem nor the solution (a role that works from a summary,
or the later stage of a pipeline that is handed a fixed form). Credit is the team's: both are paid 1
where the solver's answer verifies. The reporter's return thus hangs on what only the others saw: its
own critic (per_role: its prompt, its own value head) can learn nothing but the mean, while the
centralized critic reads the joint transcript (``info["state"]``: the problem, the solution, the acting
role's name). For the solver both critics read the problem.

Rollouts: the tiny policy samples (temperature 1) ``--train_episodes`` + ``--test_episodes`` episodes
through the real env and collector. Both critics are value heads on the policy's trunk, fitted on the
same training rollouts in closed form (ridge regression, penalty ``--alpha``, of the return on the
final hidden state at the last token of what the critic reads: a critic head whose trunk is not tuned,
so the fit is exact and the comparison is of what each view holds, not of an optimizer's luck), and
scored on the held-out ones: explained variance 1 - Var(R - V) / Var(R), overall and per role. One line
of JSON per seed, then the mean.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch

from algorithms.registry import algorithm_spec
from envs.multi_agent import MultiAgentMathVectorEnv
from envs.workflows import Role, TurnContext, Workflow
from train.collector import Collector
from train.episodes import Sampling
from models.generation import HFGenerator
from models.packing import right_padded
from models.policy import LanguagePolicy
from models.tiny import shipped_models

ROLES = ("solver", "reporter")
REPORTER_INSTRUCTION = "Reporter: reply 'noted'."


def instruction_only(role: Role, context: TurnContext) -> str:
    """The role's instruction, nothing else: it reads neither the problem nor any message."""
    return role.instruction


def two_turns(transcript, turn: int) -> tuple[int, ...]:
    return (turn,) if turn < 2 else ()


def solver_and_reporter() -> Workflow:
    reporter = Role("reporter", instruction=REPORTER_INSTRUCTION, prompt=instruction_only, answers=False)
    return Workflow("solver_and_reporter", (Role("solver"), reporter), schedule=two_turns, max_turns=2)


def rollouts(policy_dir: Path, episodes: int, seed: int) -> list[dict]:
    """Every action of ``episodes`` sampled episodes: its own prompt, the joint transcript, its role, its return."""
    env = MultiAgentMathVectorEnv(episodes, autoreset_mode="Disabled", workflow=solver_and_reporter(),
                                  arith={"seed": seed}, split="train", max_steps=4)
    sampler = LanguagePolicy(policy_dir, device="cpu", with_critic=True)
    collector = Collector(env, algorithm_spec("APPO"), 2, Sampling(max_new_tokens=48), seed=seed, critic="centralized")
    buffer, _ = collector.collect(sampler, HFGenerator(sampler), seed=seed)
    returns = (buffer.rewards * buffer.live).sum(0)  # [N, A]: one action per role, paid the team outcome
    slots = buffer.live.flatten().nonzero().squeeze(1).tolist()
    num_envs, num_agents = env.num_envs, env.num_agents
    return [{"prompt": buffer.prompt_ids[k], "state": buffer.critic_prompt_ids[k], "role": k % num_agents,
             "return": float(returns[(k // num_agents) % num_envs, k % num_agents])} for k in slots]


@torch.no_grad()
def features(policy: LanguagePolicy, prompts: list[list[int]]) -> torch.Tensor:
    """[B, H] the final hidden state at each prompt's last token: what a value head reads."""
    ids, lengths = right_padded(prompts, policy.device)
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    hidden = policy.causal_lm(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states[-1]
    return hidden[torch.arange(len(prompts)), lengths - 1].double()


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, feature mean, feature scale) of the ridge regression of ``y`` on standardised ``x``."""
    mean, scale = x.mean(0), x.std(0).clamp(min=1e-6)
    z = torch.cat([(x - mean) / scale, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    penalty = alpha * torch.eye(z.shape[1], dtype=x.dtype)
    penalty[-1, -1] = 0.0  # the bias is not shrunk
    return torch.linalg.solve(z.T @ z + penalty, z.T @ y), mean, scale


def predict(fit: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    weights, mean, scale = fit
    return torch.cat([(x - mean) / scale, torch.ones(len(x), 1, dtype=x.dtype)], dim=1) @ weights


def critic_values(policy: LanguagePolicy, train: list[dict], test: list[dict], view: str, alpha: float) -> torch.Tensor:
    """[len(test)] values of a critic fitted on ``train``: one head on the joint transcript (centralized),
    or a head per role on the role's own prompt (per_role)."""
    key = "state" if view == "centralized" else "prompt"
    x_train, x_test = features(policy, [s[key] for s in train]), features(policy, [s[key] for s in test])
    y_train = torch.tensor([s["return"] for s in train], dtype=torch.float64)
    if view == "centralized":
        return predict(ridge(x_train, y_train, alpha), x_test)
    values = torch.zeros(len(test), dtype=torch.float64)
    train_roles, test_roles = torch.tensor([s["role"] for s in train]), torch.tensor([s["role"] for s in test])
    for role in range(len(ROLES)):
        fit = ridge(x_train[train_roles == role], y_train[train_roles == role], alpha)
        values[test_roles == role] = predict(fit, x_test[test_roles == role])
    return values


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    return float(1.0 - (returns - values).var() / returns.var().clamp(min=1e-8))


def measure(policy_dir: Path, train_episodes: int, test_episodes: int, alpha: float, seed: int) -> dict:
    train, test = rollouts(policy_dir, train_episodes, seed), rollouts(policy_dir, test_episodes, seed + 1000)
    policy = LanguagePolicy(policy_dir, device="cpu")
    returns = torch.tensor([s["return"] for s in test], dtype=torch.float64)
    roles = torch.tensor([s["role"] for s in test])
    result = {"seed": seed, "test_return_mean": float(returns.mean())}
    for view in ("centralized", "per_role"):
        values = critic_values(policy, train, test, view, alpha)
        result[view] = explained_variance(values, returns)
        for k, role in enumerate(ROLES):
            result[f"{view}/{role}"] = explained_variance(values[roles == k], returns[roles == k])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=None, help="default: the shipped tiny policy")
    parser.add_argument("--train_episodes", type=int, default=512)
    parser.add_argument("--test_episodes", type=int, default=256)
    parser.add_argument("--alpha", type=float, default=100.0, help="ridge penalty on the standardised features")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    policy_dir = args.policy or shipped_models(team=False).policy
    run = functools.partial(measure, policy_dir, args.train_episodes, args.test_episodes, args.alpha)
    results = []
    for seed in args.seeds:
        results.append(run(seed))
        print(json.dumps(results[-1]), flush=True)
    keys = [key for key in results[0] if key != "seed"]
    print(json.dumps({"mean": {key: round(statistics.mean(r[key] for r in results), 4) for key in keys}}))


if __name__ == "__main__":
    main()
