"""How much of the return's variance a centralized critic explains, against per-role critics, on the same
rollouts of a workflow in which one role needs another's information.

    python bench/critic_variance.py [--policy DIR] [--train_episodes 512] [--test_episodes 256]
                                    [--epochs 8] [--lr 3e-3] [--seeds 0 1 2]

The workflow, "solver and reporter": a solver answers the problem, then a reporter acts, whose prompt is
its instruction alone: it sees neither the problem nor the solution (a role that works from a summary,
or the later stage of a pipeline that is handed a fixed form). Credit is the team's: both are paid 1
where the solver's answer verifies. The reporter's return thus hangs on what only the others saw: its
own critic (per_role: its prompt, its own value head) can learn nothing but the mean, while the
centralized critic reads the joint transcript (``info["state"]``: the problem, the solution, the acting
role's name). For the solver both critics read the problem.

Rollouts: the tiny policy samples (temperature 1) ``--train_episodes`` + ``--test_episodes`` episodes
through the real env and collector. Both critics are then fitted on the same training rollouts the way
APPO fits its critic (a LoRA critic adapter and the value head, squared error to the return, AdamW,
``--epochs`` passes of minibatches of 32 at ``--lr``) and scored on the held-out ones: explained variance
1 - Var(R - V) / Var(R), overall and per role. One line of JSON per seed, then the mean.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from algorithms.registry import algorithm_spec
from envs.multi_agent import MultiAgentMathVectorEnv
from envs.workflows import Role, TurnContext, Workflow
from train.collector import Collector, Sampling
from train.models.generation import HFGenerator
from train.models.policy import LanguagePolicy, LoraSettings
from train.tiny import TinyConfig, cache_dir

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


def fit_critic(policy_dir: Path, samples: list[dict], view: str, epochs: int, lr: float, seed: int) -> LanguagePolicy:
    """A fresh critic (LoRA critic adapter + value head; one head reading the joint transcript, or one per
    role reading its prompt) fitted to the samples' returns."""
    torch.manual_seed(seed)
    heads = 1 if view == "centralized" else len(ROLES)
    critic = LanguagePolicy(policy_dir, device="cpu", lora=LoraSettings(rank=8, alpha=16.0), with_critic=True,
                            value_heads=heads).train()
    optimizer = torch.optim.AdamW(critic.critic_parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for batch in np.array_split(rng.permutation(len(samples)), max(1, len(samples) // 32)):
            values = predict(critic, [samples[i] for i in batch], view, grad=True)
            loss = ((values - torch.tensor([samples[i]["return"] for i in batch])) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return critic.eval()


def predict(critic: LanguagePolicy, samples: list[dict], view: str, grad: bool = False) -> torch.Tensor:
    """[B] the critic's values of ``samples`` as ``view`` reads them."""
    with torch.set_grad_enabled(grad):
        if view == "centralized":
            return critic.values([s["state"] for s in samples])
        return critic.values([s["prompt"] for s in samples], [s["role"] for s in samples])


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    return float(1.0 - (returns - values).var() / returns.var().clamp(min=1e-8))


def measure(policy_dir: Path, train_episodes: int, test_episodes: int, epochs: int, lr: float, seed: int) -> dict:
    train, test = rollouts(policy_dir, train_episodes, seed), rollouts(policy_dir, test_episodes, seed + 1000)
    returns = torch.tensor([s["return"] for s in test])
    roles = torch.tensor([s["role"] for s in test])
    result = {"seed": seed, "test_return_mean": float(returns.mean())}
    for view in ("centralized", "per_role"):
        values = predict(fit_critic(policy_dir, train, view, epochs, lr, seed), test, view).float()
        result[view] = explained_variance(values, returns)
        for k, role in enumerate(ROLES):
            result[f"{view}/{role}"] = explained_variance(values[roles == k], returns[roles == k])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=None, help="default: the cached trained tiny policy")
    parser.add_argument("--train_episodes", type=int, default=512)
    parser.add_argument("--test_episodes", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    policy_dir = args.policy or cache_dir(TinyConfig()) / "policy"
    if not (policy_dir / "config.json").is_file():
        raise SystemExit(f"no policy at {policy_dir}: build the tiny models (python -m train.tiny) or pass --policy")
    run = functools.partial(measure, policy_dir, args.train_episodes, args.test_episodes, args.epochs, args.lr)
    results = []
    for seed in args.seeds:
        results.append(run(seed))
        print(json.dumps(results[-1]), flush=True)
    keys = [key for key in results[0] if key != "seed"]
    print(json.dumps({"mean": {key: round(statistics.mean(r[key] for r in results), 4) for key in keys}}))


if __name__ == "__main__":
    main()
