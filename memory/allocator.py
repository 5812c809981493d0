"""glibc's allocator kept from returning freed memory to the system between steps (docs/memory.md):
the next step reuses it instead of faulting in fresh pages."""
from __future__ import annotations

import ctypes


def keep_freed_memory() -> None:
    """Training on the CPU: keep freed memory in the process. glibc's malloc returns every freed
    block over 32 MB to the OS, so each micro-batch's activations and (V, D) gradients fault their
    pages in again (zeroed by the kernel): ~25-35% of the CPU default's update
    (docs/performance.md). No mmap'd blocks and no trimming keep them for reuse, as the
    jemalloc / tcmalloc setups recommended for PyTorch on CPUs do; the resident memory then stays at
    the run's peak. A no-op without glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    mallopt(M_MMAP_MAX, 0)  # every block from the heap, none mmap'd (and unmapped at its free)
    mallopt(M_TRIM_THRESHOLD, -1)  # (size_t) -1: never give the heap's free top back
