"""A benchmark process's memory figures (a helper of ``bench/``, not a benchmark): its resident size now and its
peak, in MiB, so a side's peak is read as ``peak_mb() - rss_mb()`` taken before it ran."""

from __future__ import annotations

import resource


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
