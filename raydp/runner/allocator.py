"""The C allocator of a training process: keep freed memory for the next step instead of returning it.

A CPU training step allocates and frees the same large tensors every step (the logits, their log-softmax and
gradient: about 8 MiB each on the benchmark default). glibc's dynamic mmap threshold soon serves them from the heap,
but when they are freed the top of the heap is trimmed (returned with ``brk``), so every step faults the same pages
in again and the kernel zeroes them: on this project's 2-core CPU machine about 250,000 minor page faults in 30 DP
steps against about 70,000 with this setting (counted in the review of this change; ``strace -c`` showed the same
number of ``mmap`` calls either way). That made a run's training loop 1.15-1.2x and one fixed-batch step about 1.4x
slower (docs/throughput.md). Raising both thresholds (``mallopt(3)``: ``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``)
keeps the pages for reuse. Nothing computed changes:
only where the memory comes from (a run with and without it gives the same figures, tests/test_throughput.py).
The process keeps up to its peak heap, which a training process reaches on its first steps anyway.

Setting either threshold turns off glibc's dynamic threshold, so both are set together. Other C libraries
(macOS, musl) are left alone. ``RAYDP_KEEP_FREED_MEMORY=0`` turns it off; it is read once per process, so on a Ray
cluster already running, pass it to the workers (``runtime_env={"env_vars": {...}}``).
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
    # mallopt returns 1 on success; the mmap threshold first, as glibc rejects one above its maximum. True only
    # when both are set (one refused leaves the other in effect, which is harmless: it only moves memory)
    mmap_set = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    _done = mmap_set and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
