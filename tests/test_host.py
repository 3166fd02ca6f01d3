"""Host memory: freed activation-sized tensors leave the resident set once the mmap threshold is fixed."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# 64 blocks of 4 MiB (a CPU activation's size) freed after a larger free raised glibc's dynamic threshold; tiny
# tensors allocated between them stay alive, so the heap cannot shrink from its top. Prints MiB: (peak - start,
# end - start).
ALLOCATE_AND_FREE = """
import os, sys
from train.host import return_freed_memory
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "fixed":
    assert return_freed_memory()
raised = bytearray(8 << 20)
del raised
start = resident()
blocks, survivors = [], []
for _ in range(64):
    blocks.append(bytearray(4 << 20))
    survivors.append(bytearray(1024))
peak = resident()
del blocks
print((peak - start) >> 20, (resident() - start) >> 20)
"""


def resident_growth(threshold: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", ALLOCATE_AND_FREE, threshold], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    peak, end = map(int, done.stdout.split())
    return peak, end


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's")
def test_freed_tensors_return_to_the_os_under_a_fixed_mmap_threshold():
    peak, end = resident_growth("dynamic")
    assert peak >= 256 and end >= 256  # glibc's default keeps every freed block
    peak, end = resident_growth("fixed")
    assert peak >= 256 and end <= 4
