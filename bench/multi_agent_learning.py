"""Does a multi-agent team learn? Held-out accuracy of the built-in workflows before and after training,
against the solver alone, with a control.

    python -m bench.multi_agent_learning [--runs chain control debate] [--iterations 200]
                                         [--n_rollout_threads 64] [--eval_limit 500] [--seed 0]
                                         [--model team|policy|DIR]

Every run is ``python train_math.py`` on the tiny team model (the default model of a multi-agent env; or,
``--model policy``, the plain policy; or any model directory), GRPO
with the default run's sampling (groups of 4 per (problem, role) at temperature 0.5) and lr, held constant
(a run extended with ``--resume`` and a larger budget keeps its step size),
held-out greedy evaluation on the first ``--eval_limit`` Arith test problems every ``--iterations / 4``
iterations (the first one, at iteration 0, is the untrained team):

- chain: ``Arith-Chain-v0`` (solver -> verifier -> refiner; the verifier solves again and accepts an
  agreeing answer), individual credit: the solver and the refiner are paid their answers, the verifier its
  verdict against the truth.
- control: the same, but each step's verifier rewards are shuffled among the envs whose verifier spoke
  (``Arith-ChainShuffledVerifier-v0``, registered here): the verifier is paid as often, for nothing it did.
- debate: ``Arith-Debate-v0`` (3 debaters x 2 rounds, majority vote), individual credit: each debater is paid
  its own answer.

Also measured: the solver alone, i.e. the same model on the single-agent ``Arith-v0`` with the same
evaluation. Prints one JSON line per run (start, best and final team accuracy, each role's held-out
metrics at the start and the end, minutes of training) and keeps the runs under ``--logdir``: a run that
finished there is read back, not trained again, and a half-finished one continues from its checkpoint
(``bench.learning_table.train_math_history``, which also refuses a run directory of other flags).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import gymnasium
import numpy as np

from bench.learning_table import train_math_history
from envs.multi_agent import MultiAgentMathVectorEnv

ROOT = Path(__file__).resolve().parents[1]
CONTROL_ID = "Arith-ChainShuffledVerifier-v0"
TINY_MODELS = ("team", "policy")
RUNS = {
    "chain": ["--env_id", "Arith-Chain-v0", "--reward_assignment", "individual"],
    "control": ["--env_id", f"bench.multi_agent_learning:{CONTROL_ID}", "--reward_assignment", "individual"],
    "debate": ["--env_id", "Arith-Debate-v0", "--reward_assignment", "individual"],
    "solver_alone": ["--env_id", "Arith-v0"],
}


class ShuffledVerifierChain(MultiAgentMathVectorEnv):
    """The chain, with each step's verifier rewards permuted among the envs whose verifier spoke in it."""

    def step(self, actions: Sequence[Sequence[Any]]):
        obs, rewards, terminated, truncated, info = super().step(actions)
        verifier = self.roles.index("verifier")
        spoke = np.flatnonzero(~np.isnan(np.asarray(info["verdict"], dtype=np.float64)[:, verifier]))
        rewards[spoke, verifier] = rewards[self.np_random.permutation(spoke), verifier]
        return obs, rewards, terminated, truncated, info


if CONTROL_ID not in gymnasium.registry:
    gymnasium.register(CONTROL_ID, entry_point="envs.multi_agent:MultiAgentMathEnv",
                       vector_entry_point="bench.multi_agent_learning:ShuffledVerifierChain",
                       kwargs={**gymnasium.spec("Arith-Chain-v0").kwargs})


def start_model(model: str) -> str:
    """The directory every run starts from: the tiny build's "team" or "policy" model, or ``model`` itself
    (a model directory, e.g. a team trained another way)."""
    if model not in TINY_MODELS:
        if not (Path(model) / "config.json").is_file():
            raise SystemExit(f"--model {model!r} is neither one of {TINY_MODELS} nor a model directory (no "
                             "config.json in it): give team, policy or a directory from_pretrained loads")
        return model
    from models.tiny import shipped_models

    return str(getattr(shipped_models(), model))


def train(name: str, args: argparse.Namespace) -> dict:
    """One run of ``train_math.py``; its evaluation history and minutes of training."""
    iterations = 0 if name == "solver_alone" else args.iterations
    turns = {"chain": 3, "control": 3, "debate": 2, "solver_alone": 1}[name]
    flags = ["--model_name_or_path", start_model(args.model), "--algorithm_name", "GRPO",
             "--n_rollout_threads", str(args.n_rollout_threads),
             "--num_env_steps", str(max(iterations, 1) * turns * args.n_rollout_threads),
             "--eval_interval", str(max(1, args.iterations // 4)), "--eval_limit", str(args.eval_limit),
             "--save_interval", "0", "--seed", str(args.seed), "--lr_schedule", "constant", *RUNS[name]]
    history = train_math_history(flags, args.logdir / name)
    return {"history": history, "minutes": round(history[-1]["seconds"] / 60, 1)}


def summary(name: str, run: dict) -> dict:
    """Start, best and final held-out team accuracy, and each role's metrics at the start and the end."""
    history = run["history"]
    first, last = history[0], history[-1]
    roles = {key: [round(first[key], 3), round(last[key], 3)] for key in first
             if key.count("/") == 2 and key in last}
    return {"run": name, "start": round(first["eval/accuracy"], 3),
            "best": round(max(h["eval/accuracy"] for h in history), 3), "final": round(last["eval/accuracy"], 3),
            "iterations": last["iteration"], "minutes": run["minutes"], "roles (start, end)": roles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["solver_alone", "chain", "control", "debate"],
                        choices=sorted(RUNS))
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--n_rollout_threads", type=int, default=64)
    parser.add_argument("--eval_limit", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="team",
                        help="the model every run starts from: the tiny team model, taught the roles (team), the "
                             "plain tiny policy, which has seen single-agent prompts only (policy), or a model "
                             "directory")
    parser.add_argument("--logdir", type=Path, default=ROOT / "runs" / "multi_agent_learning")
    args = parser.parse_args()
    for name in args.runs:
        print(json.dumps(summary(name, train(name, args))), flush=True)


if __name__ == "__main__":
    main()
