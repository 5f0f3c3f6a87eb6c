"""The C allocator of a training process: keep freed memory for the next step instead of returning it (issue 28).

A CPU training step allocates and frees the same large tensors every step (the logits, their log-softmax and
gradient: 11 MiB each on the benchmark default). With glibc's defaults, blocks above the mmap threshold are mapped
and unmapped each time, and free memory at the top of the heap is trimmed, so every step faults the same pages in
again and the kernel zeroes them. On this project's 2-core CPU machine that was 12-15% of a DP step of the
embedded model (``bench/bench_episode.py``; docs/throughput.md). Raising both thresholds (``mallopt(3)``:
``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``) keeps the pages mapped for reuse. Nothing computed changes: only where
the memory comes from (a run with and without it is the same to the last bit, tests/test_throughput.py). The
process keeps up to its peak heap, which a training process reaches on its first steps anyway.

Setting either threshold turns off glibc's dynamic threshold, so both are set together. Other C libraries
(macOS, musl) are left alone. ``RAYDP_KEEP_FREED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: glibc's malloc.h parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit: 4 MiB x sizeof(long))
MMAP_THRESHOLD = 32 * 1024 * 1024
#: free memory at the top of the heap returned to the system only beyond this
TRIM_THRESHOLD = 512 * 1024 * 1024
ENV = "RAYDP_KEEP_FREED_MEMORY"

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process, once; True when they are set (False: not glibc,
    turned off by ``RAYDP_KEEP_FREED_MEMORY=0``, or refused by the C library)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return _done
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return _done
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return _done
    # mallopt returns 1 on success; the mmap threshold first, as glibc rejects one above its maximum
    _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                        TRIM_THRESHOLD))
    return _done
