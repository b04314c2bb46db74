"""Who wrote the training run under a ``save`` directory, without torch (the API reads it at submission).

A train job's rank 0 writes ``<save>/llmjobs-run.json`` before its first step: ``{"job_id", "name", "claimed_at",
"resumed_from": {"job_id", "iteration"} | null}``. ``job_id`` is the service's job (``LLMJOBS_JOB_ID``, set by the
worker's launcher), null for the engine run standalone. A retry of the same job finds its own id there and resumes,
as Megatron does; a new job finds another id (or none: a run older than the marker) and continues it only when its
spec says ``resume: "auto"`` (``core.admission`` refuses the rest at submission, ``engine.train.job`` again at start).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

OWNER_FILE = "llmjobs-run.json"
STATE_DIR = "train_state"
TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
JOB_ID_ENV = "LLMJOBS_JOB_ID"


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """The newest complete training checkpoint under a ``save`` and the job that wrote it."""

    checkpoint: Path  # the iter_* directory
    iteration: int
    job_id: str | None  # None: written standalone, or before owners were recorded
    name: str | None


def job_identity() -> str | None:
    """This process's service job id; None when the engine runs standalone."""
    return os.environ.get(JOB_ID_ENV) or None


def latest_state(save: str | os.PathLike[str]) -> Path | None:
    """The newest complete training checkpoint under ``save`` (or ``save`` itself being ``train_state``), or None."""
    for root in (Path(save) / STATE_DIR, Path(save)):
        tracker = root / TRACKER
        try:
            iteration = int(tracker.read_text().strip()) if tracker.is_file() else None
        except (OSError, ValueError):
            iteration = None  # Megatron's "release" tracker, or a torn file: no training checkpoint of ours
        if iteration is not None and (root / f"iter_{iteration:07d}" / META).is_file():
            return root / f"iter_{iteration:07d}"
    return None


def read_owner(save: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker under ``save``, or None when there is none (or it is unreadable)."""
    try:
        owner = json.loads((Path(save) / OWNER_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return owner if isinstance(owner, dict) else None


def saved_run(save: str | os.PathLike[str]) -> SavedRun | None:
    """The run ``save`` holds, or None when it holds no complete training checkpoint."""
    found = latest_state(save)
    if found is None:
        return None
    owner = read_owner(save) or {}
    job_id, name = owner.get("job_id"), owner.get("name")
    return SavedRun(
        found,
        int(found.name.removeprefix("iter_")),
        job_id if isinstance(job_id, str) else None,
        name if isinstance(name, str) else None,
    )


def is_own(run: SavedRun, job_id: str | None) -> bool:
    """Whether ``run`` was written by ``job_id`` (an earlier attempt of the same job; standalone runs own theirs)."""
    return run.job_id == job_id


def describe(run: SavedRun) -> str:
    """ "job <id> ('name')" or a note that the writer is unknown, for messages."""
    if run.job_id is None:
        return "a run with no recorded job (the engine run standalone, or a run from before jobs were recorded)"
    return f"job {run.job_id}" + (f" ({run.name!r})" if run.name else "")


def claim(save: str | os.PathLike[str], job_id: str | None, name: str | None, resumed: SavedRun | None) -> None:
    """Record ``job_id`` as the writer of ``save`` (atomically: temp file + rename)."""
    target = Path(save) / OWNER_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "job_id": job_id,
        "name": name,
        "claimed_at": time.time(),
        "resumed_from": {"job_id": resumed.job_id, "iteration": resumed.iteration} if resumed else None,
    }
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=2))
    os.replace(tmp, target)
