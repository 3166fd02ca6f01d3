"""Host memory of a training process: freed tensors go back to the operating system.

glibc's malloc gives an allocation above its mmap threshold a mapping of its own, unmapped when freed.
But each such free raises the threshold to the freed size (up to 32 MiB), and from then on blocks of up
to that size come from the heap, where freed memory mostly stays with the process. A CPU run allocates
and frees activations of a few MiB in every layer of every pass, so its resident set grows to several
times the tensors alive at any moment. Setting the threshold once stops that adjustment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train.config import ModelConfig

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of at least 1 MiB get mappings of their own: every activation of a real model's pass, while
the many small tensors (shapes, masks, scalars) stay on the heap, where allocating is cheapest."""


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap threshold at ``threshold`` bytes for the rest of this process, so blocks of that size
    or more return to the operating system when freed; returns False, changing nothing, where the C library
    is not glibc (its allocator decides)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if libc.mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        raise OSError(f"glibc's mallopt refused an mmap threshold of {threshold} bytes (it takes 0 to 32 MiB)")
    return True


def set_up(model: ModelConfig) -> None:
    """The run's process settings: torch's CPU threads, and on a CPU device (unless the run opts out) freed
    tensors returned to the operating system (``return_freed_memory``)."""
    import torch

    from models.loading import resolve_device

    torch.set_num_threads(model.torch_threads)
    if model.return_freed_memory and resolve_device(model.device).type == "cpu":
        return_freed_memory()
