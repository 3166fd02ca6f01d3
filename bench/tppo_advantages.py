"""TPPO advantages: our vectorised action-decomposition backup vs a straightforward per-token
loop (the triple loop over envs, steps and tokens OpenR's TPPO used), at OpenR's shape
(T=8, N=32, L=96) and a larger one (T=16, N=256, L=512).

    python bench/tppo_advantages.py [--repeats 5]

Checks both agree (1e-6), then prints the median time of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from algorithms.tppo import tppo_advantages


def loop_advantages(rewards, token_values, lengths, next_values, ends, gamma, lam):
    """The recursion token by token, as a plain loop (the reference being timed)."""
    num_steps, num_envs, max_len = token_values.shape
    advantages = torch.zeros_like(token_values)
    for n in range(num_envs):
        next_first = 0.0
        for t in reversed(range(num_steps)):
            last = int(lengths[t, n]) - 1
            for j in reversed(range(last + 1)):
                if j == last:
                    delta = rewards[t, n] + gamma * next_values[t, n] - token_values[t, n, j]
                    advantages[t, n, j] = delta + gamma * lam * (1 - ends[t, n]) * next_first
                else:
                    delta = token_values[t, n, j + 1] - token_values[t, n, j]
                    advantages[t, n, j] = delta + lam * advantages[t, n, j + 1]
            next_first = advantages[t, n, 0]
    return advantages


def inputs(num_steps: int, num_envs: int, max_len: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_steps, num_envs, generator=g),
        torch.randn(num_steps, num_envs, max_len, generator=g),
        torch.randint(max_len // 2, max_len + 1, (num_steps, num_envs), generator=g),
        torch.randn(num_steps, num_envs, generator=g),
        (torch.rand(num_steps, num_envs, generator=g) < 0.2).float(),
    )


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop_repeats", type=int, default=1, help="the loop is slow at the large shape")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; at OpenR's small shape per-op overhead dominates and a second "
                             "thread contending on a shared 2-core machine made the vectorised path 10x slower")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gamma, lam = 0.99, 0.95
    summary = []
    for shape in ((8, 32, 96), (16, 256, 512)):
        data = inputs(*shape)
        vectorised = tppo_advantages(*data, gamma, lam)[0]
        torch.testing.assert_close(vectorised, loop_advantages(*data, gamma, lam), atol=1e-5, rtol=1e-5)
        fast = median_seconds(lambda: tppo_advantages(*data, gamma, lam), args.repeats)
        slow = median_seconds(lambda: loop_advantages(*data, gamma, lam), args.loop_repeats)
        print(f"T,N,L={shape}: vectorised {fast * 1e3:8.2f} ms, loop {slow * 1e3:10.1f} ms, {slow / fast:7.0f}x")
        summary.append(f"{shape}: {slow / fast:.0f}x")
    print(f"summary: tppo_advantages vectorised vs loop speed-up ({args.threads} torch threads) " + ", ".join(summary))


if __name__ == "__main__":
    main()
