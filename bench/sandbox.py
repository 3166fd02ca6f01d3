"""Calls per second of the Python tool's sandbox (``envs.sandbox.PythonSandbox``): a trivial print and a
sympy call, each batch through ``run_many`` over warm workers (one per usable core by default).

    python bench/sandbox.py [--calls 400] [--sympy_calls 100] [--workers N]

Each call is a fresh forked process with every limit and isolation layer of the default sandbox;
the figures include the round trip through the worker's pipes.
"""

from __future__ import annotations

import argparse
import time

from envs.sandbox import PythonSandbox

CASES = {
    "print": "print(1 + 1)",
    "sympy": "import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**2 - 5*x + 6), sympy.solve(x**2 - 2, x))",
}


def calls_per_second(sandbox: PythonSandbox, code: str, calls: int) -> float:
    """Calls per second of ``calls`` copies of ``code`` through ``run_many`` (after one warm-up batch)."""
    sandbox.run_many([code] * 2 * sandbox.workers)
    start = time.perf_counter()
    results = sandbox.run_many([code] * calls)
    seconds = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {calls} calls failed, e.g. {failed[0]}")
    return calls / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400, help="calls of the trivial print")
    parser.add_argument("--sympy_calls", type=int, default=100, help="calls of the sympy case")
    parser.add_argument("--workers", type=int, default=None, help="warm workers (default: usable cores, <= 8)")
    args = parser.parse_args()
    with PythonSandbox(workers=args.workers) as sandbox:
        print(sandbox.describe_isolation())
        for name, calls in (("print", args.calls), ("sympy", args.sympy_calls)):
            rate = calls_per_second(sandbox, CASES[name], calls)
            print(f"{name}: {rate:.0f} calls/s ({calls} calls, {sandbox.workers} workers)")


if __name__ == "__main__":
    main()
