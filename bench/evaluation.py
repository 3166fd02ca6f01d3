"""One held-out evaluation of MATH-500 as OpenR's command runs it, with our HF backend.

    python bench/evaluation.py [--policy DIR] [--limit 500] [--max_new_tokens 64] [--arith] [--tools python]

500 envs in one batch (``--eval_batch_size`` 500), step-level actions (generation stops at the step
delimiter; EOS ends the episode), greedy decoding, the outcome verifier: ``train.evaluation.evaluate``
on a ``MATH-v0`` vector env, exactly what the runner calls. Prints CPU and wall seconds (1 torch thread;
CPU seconds stay comparable on a shared machine), accuracy and mean solution length, so a change to the
generator can be checked for speed and for identical greedy results in one line.

``--arith`` evaluates the tiny build's held-out Arith problems instead (those behind its metrics.json);
``--tools python`` runs a step ending in a fenced python block in the sandbox, its output a tool turn
(without it the block is left unrun), as in ``Arith-Tool-v0``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gymnasium
import torch
from gymnasium.vector import AutoresetMode

import envs  # noqa: F401  (registers MATH-v0)
from envs.datasets import MATH500
from envs.prompts import STEP_DELIMITER
from envs.vector import MathVectorEnv
from train.episodes import Sampling
from train.evaluation import evaluate
from models.generation import make_generator
from models.policy import LanguagePolicy
from models.tiny import shipped_models
from models.tiny.data import heldout_problems



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=None, help="model directory (default: the shipped tiny policy)")
    parser.add_argument("--limit", type=int, default=500, help="problems (and envs)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens per step")
    parser.add_argument("--arith", action="store_true", help="the tiny build's held-out Arith problems, not MATH-500")
    parser.add_argument("--tools", choices=["python"], default=None,
                        help="run the policy's python blocks (the sandbox)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = LanguagePolicy(args.policy or shipped_models(team=False).policy, device="cpu")
    eos = policy.tokenizer.eos_token or ""
    env = _env(args.arith, args.tools, args.limit, eos)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, stop=(STEP_DELIMITER,), eos_text=eos)
    wall, cpu = time.perf_counter(), time.process_time()
    result = evaluate(env, make_generator("hf", policy), sampling, limit=args.limit)
    task = "arith" if args.arith else "math500"
    print(f"summary: evaluation {task} x {args.limit}, tools {args.tools}, step actions, greedy, "
          f"{args.max_new_tokens} tokens per step: "
          f"{time.process_time() - cpu:.1f} CPU s, {time.perf_counter() - wall:.1f} s wall, accuracy "
          f"{result['eval/accuracy']:.4f}, mean length {result['eval/mean_length']:.3f} tokens"
          + (f", tool calls {result['eval/tool_calls']:.3f} of the steps" if "eval/tool_calls" in result else ""))


def _env(arith: bool, tools: str | None, limit: int, eos: str) -> MathVectorEnv:
    """``limit`` envs, one per held-out problem (MATH-500's, or the tiny build's Arith ones)."""
    common = dict(group_size=1, autoreset_mode=AutoresetMode.DISABLED, end_marker=eos, tools=tools)
    if tools:
        common["tool_workers"] = 1
    if arith:
        return MathVectorEnv(limit, problems=heldout_problems()[:limit], max_steps=8, **common)
    return gymnasium.make_vec("MATH-v0", num_envs=limit, vectorization_mode="vector_entry_point",
                              dataset_path=str(MATH500), limit=limit, **common)


if __name__ == "__main__":
    main()
