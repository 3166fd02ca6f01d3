"""Data parallelism under ``torchrun``: process groups, the ranks' share of the work, and reductions.

``torchrun --nproc_per_node N train_math.py ...`` (or SLURM's srun, or any launcher that sets torchrun's
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) starts N processes; without that
environment the same code runs as one process and nothing here communicates.

- Backend from the device: gloo on CPU, NCCL on CUDA (each rank on ``cuda:LOCAL_RANK``). Every
  collective carries ``--dist_timeout``: a rank that hangs or died makes the others raise within it
  instead of waiting forever (torchrun then stops the job and names the rank that failed first).
- Each rank owns whole prompt groups (``shard``), so group advantages stay local, and every random
  draw derives from (seed, iteration, global sample index), never from the rank (envs and collector).
- Gradients: a LoRA policy is wrapped in DDP (every rank holds the whole model), a fully fine-tuned one
  is sharded with FSDP2 (``LanguagePolicy.fully_shard``: weights, gradients and optimizer state split
  over the ranks; ``--data_parallel`` chooses; only rank 0 reads the weights, the other ranks build on
  the meta device and receive their shards); both average gradients over ranks, so losses are
  normalised by the global sample or token count (``all_reduce_sum`` of the minibatch totals) and
  scaled by the world size: N ranks compute the gradient one process would on all their samples.
- Rank 0 alone writes TensorBoard, the progress bar and the policy export; statistics are sums and
  counts added over ranks first. Checkpoints are written by every rank (``train.checkpoint_files``: DCP).
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: ``rank`` of ``world_size`` (``local_rank`` on its node)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_ranks() -> Ranks:
    """The ranks of a process group a launcher already started (e.g. Ray Train's), else the ones
    torchrun's environment describes (one process when it is absent)."""
    if dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" not in os.environ:
        return Ranks()
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} are not: launch with torchrun (or a launcher "
                         "that sets all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def init(device: str, timeout_s: float) -> Ranks:
    """Joins the process group of a torchrun job (nothing for one process). On CUDA each rank takes GPU
    ``LOCAL_RANK`` as its current device, so ``cuda`` means that one."""
    ranks = launched_ranks()
    if not ranks.distributed or dist.is_initialized():
        return ranks
    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("nccl" if wants_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    atexit.register(shutdown)
    if not ranks.is_main:  # rank 0 alone tells how the run goes; warnings and errors come from every rank
        for logger in (logging.getLogger(), logging.getLogger("absl")):
            logger.setLevel(logging.WARNING)
    return ranks


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(total_envs: int, group_size: int, ranks: Ranks) -> tuple[int, int]:
    """``(first global env, envs)`` of this rank: whole groups, the same count on every rank."""
    groups = total_envs // group_size
    if groups % ranks.world_size:
        raise ValueError(f"{groups} prompt groups (--n_rollout_threads={total_envs} / --group_size={group_size}) do "
                         f"not split evenly over {ranks.world_size} ranks: each rank owns whole groups; use a "
                         f"multiple of {ranks.world_size * group_size} envs")
    per_rank = groups // ranks.world_size * group_size
    return ranks.rank * per_rank, per_rank


def all_reduce_sum(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Element-wise sums over ranks of float64 ``values`` (themselves with one process)."""
    return all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Element-wise maxima over ranks of float64 ``values`` (themselves with one process)."""
    return all_reduce(values, dist.ReduceOp.MAX)


def all_reduce(values: Sequence[float] | np.ndarray, op: dist.ReduceOp) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if not dist.is_initialized():
        return array
    tensor = torch.from_numpy(array.copy())
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.cpu().numpy()


def all_reduce_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over ranks (a new tensor; the algorithms' ``reduce_sum`` under torchrun)."""
    summed = tensor.detach().clone()
    dist.all_reduce(summed)
    return summed


def sum_in_place(tensors: list[torch.Tensor]) -> None:
    """Each tensor replaced by its sum over ranks (one flat all-reduce for all of them)."""
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def sum_by_key(*mappings: Mapping[str, float]) -> list[dict[str, float]]:
    """Each mapping with its values summed over ranks, key by key (a key some rank lacks counts 0 there):
    one gather of the keys and one all-reduce for all of them."""
    keys = [sorted(set().union(*rank_keys)) for rank_keys in zip(*all_gather_objects([list(m) for m in mappings]))]
    sums = all_reduce_sum([m.get(key, 0.0) for m, names in zip(mappings, keys) for key in names])
    out, offset = [], 0
    for names in keys:
        out.append(dict(zip(names, sums[offset:offset + len(names)].tolist())))
        offset += len(names)
    return out


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` with one process)."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered

