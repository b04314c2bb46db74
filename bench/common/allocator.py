"""glibc's malloc setting the memory benchmarks give both of their sides (a helper of ``bench/``, not a benchmark).

On CPU a benchmark's peak memory is the process's peak RSS, and glibc decides how much freed memory stays in it: its
mmap threshold rises to the largest block freed (up to 32 MiB), and blocks below it then come from heaps that are
rarely given back. What a run keeps then depends on its tensors' sizes as much as on what it holds: halving a
sequence (context parallelism) moves activations under the threshold, and two trainers with different buffer sizes
keep different amounts of freed memory. Pinned at 128 KiB (``MALLOC_MMAP_THRESHOLD_``, which also stops the
threshold from moving) freed tensors go back to the system and RSS follows the live tensors, as an accelerator's
allocator reports them (``max_memory_allocated``). It costs time (more mmap calls), on both sides alike.
"""

from __future__ import annotations

import argparse
import os

PINNED = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # 128 KiB


def add_malloc_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--malloc",
        choices=("pinned", "default"),
        default="pinned",
        help="glibc's mmap threshold for both sides: pinned at 128 KiB (default) or glibc's adaptive one",
    )


def malloc_env(choice: str) -> dict[str, str]:
    """The environment entries a side's process starts with for ``--malloc choice``."""
    return dict(PINNED) if choice == "pinned" else {}


def apply_to_children(choice: str) -> None:
    """Set ``--malloc choice`` in this process's environment for the processes it starts from now on (glibc reads it
    at process start, so this process itself is unchanged)."""
    for key in PINNED:
        os.environ.pop(key, None)
    os.environ.update(malloc_env(choice))
