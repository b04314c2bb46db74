"""Deleting a finished job: its rows (events, metrics, logs, artifacts, a pipeline's steps: the foreign keys cascade),
its run directory, and with ``outputs`` the files and directories its artifacts list.

Only what lies strictly inside the configured roots is removed (run directories below ``runs_dir``, outputs below the
job's team's data areas), so a row naming another path can never make the service delete it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from core.errors import ApiError
from core.models import Artifact, Job
from core.paths import team_areas
from core.settings import Settings
from core.states import JobState


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(root in path.parents for root in roots)


def _remove(path_text: str, roots: list[Path]) -> str | None:
    path = Path(path_text)
    if not path.is_absolute() or not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink():  # the link itself, never what it points at
        if not _inside(path.parent.resolve(), roots) and path.parent.resolve() not in roots:
            return None
        path.unlink()
        return str(path)
    resolved = path.resolve()
    if not _inside(resolved, roots):
        return None
    if resolved.is_dir():
        shutil.rmtree(resolved)
    else:
        resolved.unlink()
    return str(resolved)


def delete_job(session: Session, settings: Settings, job: Job, outputs: bool = False) -> dict[str, Any]:
    """409 unless the job (and every step of a pipeline) has ended; returns what was removed."""
    family = [job, *session.scalars(select(Job).where(Job.parent_id == job.id))]
    active = [j for j in family if not JobState(j.state).is_terminal()]
    if active:
        raise ApiError(
            409,
            "job_active",
            f"job {active[0].id} is {active[0].state}; cancel it and wait for it to end before deleting",
            None,
        )
    ids = [j.id for j in family]
    paths = [j.run_dir for j in family]
    output_paths: list[str] = []
    if outputs:
        for artifact in session.scalars(select(Artifact).where(Artifact.job_id.in_(ids))):
            output_paths += [*artifact.files, artifact.path]
    session.execute(delete(Job).where(Job.id.in_(ids[1:])))
    session.execute(delete(Job).where(Job.id == job.id))
    session.commit()
    removed = [p for p in (_remove(p, [settings.runs_path]) for p in paths) if p]
    try:  # outputs are removed only inside the job's own team's areas, where it could write them (core.paths)
        areas = team_areas(settings, job.team).write
    except ValueError:  # a team name from before names were checked: no area, nothing removed
        areas = []
    removed += [p for p in (_remove(p, areas) for p in output_paths) if p]
    return {"id": job.id, "object": "job.deleted", "deleted": True, "removed": removed}
