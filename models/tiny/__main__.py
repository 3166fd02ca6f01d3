"""``python -m models.tiny --out DIR``: build (or find) the tiny models and print their metrics.

``--out models/tiny/shipped`` (after removing that directory) remakes the build the package ships."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from models.tiny.build import build_tiny_models
from models.tiny.config import TinyConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.tiny",
                                     description="Build the tiny tokenizer, policy, PRM, target, tool and team models.")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the user cache, "
                        "$MATHRL_CACHE/tiny/<config hash>)")
    parser.add_argument("--seed", type=int, default=TinyConfig.seed)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: every core; when another job shares the cores, "
                             "fewer threads can be faster)")
    parser.add_argument("--team", action=argparse.BooleanOptionalAction, default=True,
                        help="build the team model too (the multi-agent envs' default model)")
    parser.add_argument("--tool", action=argparse.BooleanOptionalAction, default=True,
                        help="build the tool model too (the policy taught to call the Python tool)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    models = build_tiny_models(args.out, TinyConfig(seed=args.seed), args.device, args.threads, args.team, args.tool)
    keys = ("vocab_size", "num_parameters", "policy", "target", "prm", "build_seconds")
    summary = {k: models.metrics[k] for k in keys}
    summary["tool"] = models.metrics.get("tool")  # absent with --no-tool, unless an earlier build made it
    summary["team"] = models.metrics.get("team")  # absent with --no-team, unless an earlier build made it
    print(json.dumps({"root": str(models.root), **summary}, indent=1))


if __name__ == "__main__":
    main()
