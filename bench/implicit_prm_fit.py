"""How fast PRIME's implicit PRM learns to predict outcomes, by learning rate and beta, on fixed rollouts.

    python bench/implicit_prm_fit.py [--policy DIR] [--train_episodes 2048] [--test_episodes 512]
                                     [--batch 64] [--lrs 1e-5 1e-4 1e-3] [--betas 0.05 0.5] [--seed 0]

The tiny policy samples (temperature 1) whole Arith solutions through the real env and collector; each
is labelled by whether its answer verifies. An ``ImplicitPRM`` that starts from the policy's weights (as
PRIME's does) then takes one optimizer step per batch of ``--batch`` training solutions, as the trainer
does once per rollout, and after every ``--report_every`` steps it scores the held-out solutions: ROC-AUC
and accuracy of its outcome score beta * sum_t log(pi_psi / pi_ref) against their labels. The rollouts
come from one policy, not a policy that moves as in training, so this measures the PRM's own learning:
how many rollout batches it needs before its process rewards carry signal. One line of JSON per
(lr, beta).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from algorithms.base import roc_auc
from algorithms.buffer import Batch
from algorithms.registry import algorithm_spec
from envs.vector import MathVectorEnv
from reward_models.implicit_prm import ImplicitPRM
from train.collector import Collector
from train.episodes import Sampling
from models.generation import HFGenerator
from models.policy import LanguagePolicy
from models.tiny import shipped_models


def rollouts(policy_dir: Path, episodes: int, seed: int) -> tuple[Batch, torch.Tensor]:
    """(``episodes`` sampled solutions as one Batch, their labels [episodes] in {0, 1})."""
    env = MathVectorEnv(episodes, autoreset_mode="Disabled", arith={"seed": seed}, split="train", max_steps=1)
    sampler = LanguagePolicy(policy_dir, device="cpu")
    collector = Collector(env, algorithm_spec("RLOO"), 1, Sampling(max_new_tokens=64), seed=seed)
    buffer, _ = collector.collect(sampler, HFGenerator(sampler), seed=seed)
    rows = buffer.rows()
    return rows, buffer.episode_correct_at(rows.index)


def subset(rows: Batch, index: torch.Tensor) -> tuple[list[list[int]], tuple[torch.Tensor, torch.Tensor]]:
    """(prompts, (action ids, action lengths)) of the rows ``index``."""
    return [rows.prompt_ids[i] for i in index.tolist()], (rows.action_ids[index], rows.action_lengths[index])


@torch.no_grad()
def heldout(prm: ImplicitPRM, rows: Batch, labels: torch.Tensor, batch: int) -> dict[str, float]:
    """ROC-AUC and accuracy (score > 0) of the outcome score on ``rows``."""
    scores = torch.cat([prm.outcome_scores(*subset(rows, index)).cpu()
                        for index in torch.arange(len(labels)).split(batch)])
    accuracy = float(((scores > 0).float() == labels).float().mean())
    return {"auc": round(roc_auc(scores, labels), 4), "accuracy": round(accuracy, 4)}


def fit(policy_dir: Path, train: tuple[Batch, torch.Tensor], test: tuple[Batch, torch.Tensor], lr: float,
        beta: float, batch: int, report_every: int, seed: int) -> dict:
    torch.manual_seed(seed)
    prm = ImplicitPRM(LanguagePolicy(policy_dir, device="cpu"), beta=beta, lr=lr)
    rows, labels = train
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    curve, losses, started = [], [], time.perf_counter()
    for step, index in enumerate(order.split(batch), start=1):
        losses.append(prm.update(*subset(rows, index), labels[index])[0])
        if step % report_every == 0 or step * batch >= len(labels):
            recent = losses[-report_every:]
            curve.append({"step": step, "train_loss": round(sum(recent) / len(recent), 4),
                          **heldout(prm, *test, batch)})
    return {"lr": lr, "beta": beta, "seconds": round(time.perf_counter() - started, 1), "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=None, help="default: the shipped tiny policy")
    parser.add_argument("--train_episodes", type=int, default=2048)
    parser.add_argument("--test_episodes", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="solutions per optimizer step (one rollout's worth)")
    parser.add_argument("--report_every", type=int, default=4, help="optimizer steps between held-out scores")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3])
    parser.add_argument("--betas", type=float, nargs="+", default=[0.05, 0.5])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    policy_dir = args.policy or shipped_models(team=False).policy
    train = rollouts(policy_dir, args.train_episodes, args.seed)
    test = rollouts(policy_dir, args.test_episodes, args.seed + 1000)
    print(json.dumps({"train_accuracy": round(float(train[1].mean()), 4),
                      "test_accuracy": round(float(test[1].mean()), 4)}))
    for lr, beta in itertools.product(args.lrs, args.betas):
        print(json.dumps(fit(policy_dir, train, test, lr, beta, args.batch, args.report_every, args.seed)), flush=True)


if __name__ == "__main__":
    main()
