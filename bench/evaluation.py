"""One held-out evaluation of MATH-500 as OpenR's command runs it, with our HF backend.

    python bench/evaluation.py [--policy DIR] [--limit 500] [--max_new_tokens 64]

500 envs in one batch (``--eval_batch_size`` 500), step-level actions (generation stops at the step
delimiter; EOS ends the episode), greedy decoding, the outcome verifier: ``train.evaluation.evaluate``
on a ``MATH-v0`` vector env, exactly what the runner calls. Prints CPU and wall seconds (1 torch thread;
CPU seconds stay comparable on a shared machine), accuracy and mean solution length, so a change to the
generator can be checked for speed and for identical greedy results in one line.
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
from train.collector import Sampling
from train.evaluation import evaluate
from models.generation import make_generator
from models.policy import LanguagePolicy
from models.tiny import shipped_models



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=None, help="model directory (default: the shipped tiny policy)")
    parser.add_argument("--limit", type=int, default=500, help="problems (and envs)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = LanguagePolicy(args.policy or shipped_models(team=False).policy, device="cpu")
    eos = policy.tokenizer.eos_token or ""
    env = gymnasium.make_vec("MATH-v0", num_envs=args.limit, vectorization_mode="vector_entry_point", group_size=1,
                             autoreset_mode=AutoresetMode.DISABLED, dataset_path=str(MATH500), limit=args.limit,
                             end_marker=eos)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, stop=(STEP_DELIMITER,), eos_text=eos)
    wall, cpu = time.perf_counter(), time.process_time()
    result = evaluate(env, make_generator("hf", policy), sampling, limit=args.limit)
    print(f"summary: evaluation math500 x {args.limit}, step actions, greedy, {args.max_new_tokens} tokens per step: "
          f"{time.process_time() - cpu:.1f} CPU s, {time.perf_counter() - wall:.1f} s wall, accuracy "
          f"{result['eval/accuracy']:.4f}, mean length {result['eval/mean_length']:.3f} tokens")


if __name__ == "__main__":
    main()
