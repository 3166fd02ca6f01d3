"""Per-rank peak memory of an FSDP2 start on 2 gloo ranks: every rank reading the whole model (before)
against rank 0 reading it and the others building on the meta device (``weights_from_rank0``).

    python -m bench.sharded_start [--model 0.5b]

The model is a random-init Qwen2.5 config written by ``bench/memory.py`` (bfloat16 on disk; the policy
keeps fp32 master weights, as full fine-tuning does). Each rank builds the policy, shards it
(``LanguagePolicy.fully_shard``, which runs one forward) and reports its peak resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.memory import MODELS, write_model

RESULT = "RESULT "


def rank_main(model_dir: str, from_rank0: bool) -> None:
    """One torchrun rank: build, shard, report the peak RSS."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models.policy import LanguagePolicy

    dist.init_process_group("gloo")
    policy = LanguagePolicy(model_dir, device="cpu", weights_from_rank0=from_rank0)
    policy.fully_shard(init_device_mesh("cpu", (dist.get_world_size(),)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(RESULT + json.dumps({"rank": dist.get_rank(), "peak_gib": peak}), flush=True)
    dist.destroy_process_group()


def measure(model_dir: Path, from_rank0: bool) -> list[float]:
    """Peak GiB of each of 2 ranks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--module",
               "bench.sharded_start", "--rank_of", str(model_dir), *(["--from_rank0"] if from_rank0 else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = [json.loads(line.split(RESULT, 1)[1]) for line in done.stdout.splitlines() if RESULT in line]
    if done.returncode != 0 or len(results) != 2:
        raise RuntimeError(f"torchrun failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return [result["peak_gib"] for result in sorted(results, key=lambda r: r["rank"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="0.5b")
    parser.add_argument("--rank_of", help=argparse.SUPPRESS)
    parser.add_argument("--from_rank0", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        return rank_main(args.rank_of, args.from_rank0)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_model(args.model, Path(scratch) / args.model)
        print(f"FSDP2 start, 2 gloo ranks, random-init Qwen2.5-{args.model} config, fp32 master weights")
        print(f"{'start':<22} {'rank 0 GiB':>10} {'rank 1 GiB':>10}")
        for label, from_rank0 in (("every rank reads", False), ("rank 0 reads (meta)", True)):
            peaks = measure(model_dir, from_rank0)
            print(f"{label:<22} {peaks[0]:10.2f} {peaks[1]:10.2f}", flush=True)


if __name__ == "__main__":
    main()
