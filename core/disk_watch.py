"""Free space under each data root: new jobs that would write to a nearly full root wait; running ones are told.

- Below ``disk_wait_below_bytes`` (the high watermark) a waiting job whose outputs (``save``, ``save_dir``,
  ``output_prefix``) lie under that root is not started: its ``pending_reason`` names the root and its free space
  (``held_jobs``, called by the scheduling pass; the specs are read only while some root is low).
- Below ``disk_warn_below_bytes`` (the low watermark) each running job writing there gets one ``disk_low`` event per
  episode (``warn_running``, the reconciler's pass), announced as the ``job.disk_low`` webhook. The engine refuses a
  checkpoint that would not fit before it starts (``engine.checkpoint.dcp.no_room``) and a write that runs out of
  space fails the job ``disk_full`` with the previous checkpoint intact.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db import session_scope
from core.jobs import add_event
from core.models import Job
from core.settings import Settings
from core.states import RUNNING

log = logging.getLogger(__name__)
OUTPUT_FIELDS = ("save", "save_dir", "output_prefix")  # where a job's engine writes (engine.contract.guard)
CACHE_S = 5.0  # a pass asks often; statvfs of a network filesystem is not free
GiB = 2**30


@dataclass(frozen=True)
class RootSpace:
    root: Path
    free: int
    total: int


_cache: dict[tuple[Path, ...], tuple[float, list[RootSpace]]] = {}
_told: set[tuple[str, Path]] = set()  # (job, root) told during the current low episode of the root
_lock = threading.Lock()


def root_space(settings: Settings) -> list[RootSpace]:
    """Free and total bytes of each data root (cached for ``CACHE_S``); a root that cannot be read is left out."""
    key = tuple(settings.data_roots)
    now = time.monotonic()
    with _lock:
        hit = _cache.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1]
    found = []
    for root in key:
        try:
            usage = shutil.disk_usage(root)
        except OSError as err:
            log.warning("data root %s: cannot read its free space: %s", root, err)
            continue
        found.append(RootSpace(root, usage.free, usage.total))
    with _lock:
        _cache[key] = (now, found)
    return found


def forget_cache() -> None:
    with _lock:
        _cache.clear()


def low_roots(settings: Settings, below: int) -> list[RootSpace]:
    return [r for r in root_space(settings) if below and r.free < below]


def written_roots(spec: dict[str, Any], roots: list[RootSpace]) -> list[RootSpace]:
    """Which of ``roots`` the job's outputs lie under (the longest matching root for each output)."""
    hit: list[RootSpace] = []
    for name in OUTPUT_FIELDS:
        value = spec.get(name)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value)
        under = [r for r in roots if path == r.root or r.root in path.parents]
        if under:
            best = max(under, key=lambda r: len(r.root.parts))
            if best not in hit:
                hit.append(best)
    return hit


def reason(space: RootSpace, settings: Settings) -> str:
    return (
        f"data root {space.root} has {space.free / GiB:.1f} GiB free, below disk_wait_below_bytes "
        f"({settings.disk_wait_below_bytes / GiB:.1f} GiB): jobs that write there wait until space is freed"
    )


def held_jobs(session: Session, settings: Settings, job_ids: list[str]) -> dict[str, str]:
    """Of ``job_ids``, those that write under a root below the high watermark, with their pending reason."""
    lows = low_roots(settings, settings.disk_wait_below_bytes)
    if not lows or not job_ids:
        return {}
    held = {}
    for job_id, spec in session.execute(select(Job.id, Job.spec).where(Job.id.in_(job_ids))):
        hit = written_roots(spec or {}, lows)
        if hit:
            held[job_id] = reason(hit[0], settings)
    return held


def warn_running(settings: Settings) -> int:
    """One ``disk_low`` event for each running job writing under a root below the low watermark (once per episode:
    told again only after the root recovered). Returns how many were told."""
    lows = low_roots(settings, settings.disk_warn_below_bytes)
    with _lock:
        low_paths = {r.root for r in lows}
        _told.difference_update({t for t in _told if t[1] not in low_paths})  # recovered roots: a new episode later
    if not lows:
        return 0
    told = 0
    with session_scope(settings.database_url) as session:
        running = session.execute(
            select(Job.id, Job.spec, Job.attempt_count).where(Job.state.in_([s.value for s in RUNNING]))
        ).all()
        for job_id, spec, attempt in running:
            for space in written_roots(spec or {}, lows):
                with _lock:
                    if (job_id, space.root) in _told:
                        continue
                    _told.add((job_id, space.root))
                add_event(
                    session,
                    job_id,
                    "disk_low",
                    f"data root {space.root} has {space.free / GiB:.2f} GiB free (below disk_warn_below_bytes): "
                    "checkpoints that would not fit are refused; free space or the job may end disk_full",
                    level="warning",
                    data={"root": str(space.root), "free_bytes": space.free, "total_bytes": space.total},
                    attempt=attempt,
                )
                told += 1
    return told
