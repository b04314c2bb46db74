"""The garbage collector in the control plane's long-running processes (the API, a worker).

A collection of the oldest generation traverses every tracked object of the process: in a started API or worker
(SQLAlchemy's and pydantic's modules, compiled statements, the app) that is several hundred thousand objects, tens of
milliseconds of CPU, charged to whichever scheduling pass happened to allocate the object that triggered it (issue
47: a pass's CPU p99 was such collections, its p50 a fifth of it). What exists once a process has started lives as
long as the process: ``settle_heap`` moves it out of the collector's reach (``gc.freeze``), so later collections
traverse only what was allocated since, and collects the youngest generation less often (each such collection
costs its live objects, not the allocations counted, so a larger threshold means fewer, not longer, pauses in a
process that frees most of what it allocates)."""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000  # CPython's default is 700


def settle_heap(gen0_threshold: int = GEN0_THRESHOLD) -> int:
    """Call once, after start-up, in a process that runs until it stops (never in a test process: what is frozen is
    never collected). Returns how many objects were frozen."""
    if gen0_threshold < 1:
        raise ValueError(f"gen0_threshold: must be at least 1, got {gen0_threshold}")
    gc.collect()  # start-up's garbage first: what is frozen is never freed
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
    return gc.get_freeze_count()
