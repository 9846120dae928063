"""Freed tensor memory given back to the operating system (glibc's malloc), for the training runs.

Why: glibc serves an allocation above its mmap threshold (128 KiB at start) with its own mapping, which
``free`` unmaps, so the memory leaves the process. But each time such a block is freed, glibc raises the
threshold to that block's size (up to 32 MiB on 64-bit), so later tensors below it come from the heap,
whose freed memory mostly stays with the process. A training step allocates and frees hundreds of
megabytes in tensors of a few MiB (a block's gathered weights, its gradients before the reduce-scatter),
and the process's resident memory grows by that much for good: distilling a 1.5 GB Llama under torchrun
with two processes peaked at 6.56 GB per process with glibc's default and 5.48 GB with the threshold
fixed at 1 MiB (benchmarks/bench_distill_memory.py). Fixing it (``mallopt(M_MMAP_THRESHOLD)``) also stops
the raising.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's malloc.h: the parameter number of M_MMAP_THRESHOLD
_M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20


def give_back_freed_tensors(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; whether it was set (False on
    another C library or platform, where nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
