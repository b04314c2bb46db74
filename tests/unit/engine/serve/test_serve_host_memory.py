"""``engine.serve.host_memory``: with it, a serving process's large temporaries reuse freed memory instead of
faulting fresh pages in at every forward (run in child processes: the allocator's settings are process-wide)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

CYCLE = """
import ctypes, ctypes.util, json, resource, sys
import torch
from engine.serve import host_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
# no transparent huge pages (THP "always", or torch's THP_MEM_ALLOC_ENABLE): a 2 MiB page per fault would cut the
# plain run's faults below the count asserted
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
# glibc's own starting thresholds, fixed (its dynamic raise would make the plain run's faults vary from run to run)
mallopt = libc.mallopt
mallopt(host_memory.M_MMAP_THRESHOLD, 128 << 10)
mallopt(host_memory.M_TRIM_THRESHOLD, 128 << 10)
kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(8):  # a prefill's shape of temporaries: a few MiB each, freed before the next forward
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    layers = [torch.ones(512, 3072) for _ in range(8)]  # a forward's activations, freed together at its end
    del layers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults[4:]}))
"""


def _cycle(mode: str) -> tuple[bool, list[int]]:
    """(whether the settings were applied, the minor page faults of each forward after the first few)."""
    out = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True, text=True, check=True).stdout
    found = json.loads(out.splitlines()[-1])
    return bool(found["kept"]), [int(n) for n in found["faults"]]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_freed_temporaries_are_reused_not_faulted_in_again() -> None:
    (_, plain), (applied, kept) = _cycle("plain"), _cycle("keep")
    assert applied
    pages = 8 * 512 * 3072 * 4 // 4096  # the eight 6 MiB tensors' pages
    assert min(plain) > pages // 2  # without it: fresh pages, forward after forward
    assert max(kept) < pages // 20  # with it: the freed memory is reused
