"""``core.gc_tuning.settle_heap``: a started process's objects leave the collector's reach, later garbage is still
collected. Run in a child process: what a test process freezes would never be collected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.gc_tuning import GEN0_THRESHOLD, settle_heap

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import gc, json, time, weakref
import sqlalchemy.orm  # a started process's modules
from core.gc_tuning import settle_heap

tracked = len(gc.get_objects())
frozen = settle_heap()

class Cycle:
    pass

a, b = Cycle(), Cycle()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
began = time.thread_time()
gc.collect()
full_ms = (time.thread_time() - began) * 1000
print(json.dumps({"tracked": tracked, "frozen": frozen, "left": len(gc.get_objects()), "threshold": gc.get_threshold(),
                  "cycle_freed": alive() is None, "full_ms": full_ms}))
"""


def test_settle_heap_freezes_the_started_process_and_still_collects_new_garbage() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 0.9 * got["tracked"]  # nearly everything alive after start-up is frozen
    assert got["left"] < 0.05 * got["frozen"]  # a full collection now traverses only what came after
    assert got["threshold"][0] == GEN0_THRESHOLD
    assert got["cycle_freed"]  # garbage made after settling is still collected


def test_settle_heap_refuses_a_threshold_below_one() -> None:
    with pytest.raises(ValueError, match="gen0_threshold"):
        settle_heap(0)
