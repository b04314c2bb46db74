"""The serving process keeps the host memory its forwards free, instead of handing it back to the kernel each time.

glibc serves a large allocation with its own ``mmap`` (above a threshold it raises itself only up to 32 MiB after
frees) and returns the top of the heap to the kernel once more than ``M_TRIM_THRESHOLD`` is free there. A CPU
prefill allocates and frees activations of megabytes per layer (a 512-token chunk of the serve_peer model: its MLP's
(512, 3072) fp32 output is 6 MiB), so every forward faulted its pages in afresh: ~22,000-24,000 minor page faults per
512-token prefill step, and 20-24 % of its CPU time at 1 thread (``bench`` figures in the commit). With the mmap
threshold at its maximum and trimming off (what vLLM's CPU docs get by preloading tcmalloc), the freed memory is
reused: the process holds its peak working set, which it needs again at the next prefill anyway. Only on glibc, and
only where the allocator is glibc's (an ``LD_PRELOAD``-ed allocator ignores ``mallopt``); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest accepted value on 64-bit (4 MiB * sizeof(long))
TRIM_THRESHOLD = 1 << 30  # free heap top kept before trimming: far above any forward's temporaries here


def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold to its maximum and its trim threshold to ``TRIM_THRESHOLD``; True when set."""
    if platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = ctypes.CDLL(name).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("serving: freed host memory kept for reuse (glibc mallopt): %s", done)
    return done
