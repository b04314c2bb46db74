"""A job seen as an MLflow run: its experiment (``metadata.experiment``, else the team's name), its spec's fields
flattened into params, its job-wide metric series (rank null) as metrics with their steps, and its name, kind, state
and labels as tags beside MLflow's system tags. Read-only: the job's own rows are the record."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from core.mlflow_search import RunView
from core.models import Job, MetricPoint

EXPERIMENT_LABEL = "experiment"
_STATUS = {
    "queued": "SCHEDULED",
    "retrying": "SCHEDULED",
    "starting": "RUNNING",
    "running": "RUNNING",
    "cancelling": "RUNNING",
    "succeeded": "FINISHED",
    "failed": "FAILED",
    "cancelled": "KILLED",
}
CHUNK = 500  # ids per IN (...) list


def millis(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


def experiment_of(job: Job, team: str) -> str:
    return str((job.meta or {}).get(EXPERIMENT_LABEL) or team)


def in_experiment(name: str, team: str) -> ColumnElement[bool]:
    """The team's jobs grouped under experiment ``name`` (the team's own name holds the unlabelled ones)."""
    label = Job.meta[EXPERIMENT_LABEL].as_string()
    return or_(label == name, label.is_(None)) if name == team else label == name


def experiment_names(session: Session, team: str) -> set[str]:
    """Every experiment the team's jobs name, and the team's default."""
    label = Job.meta[EXPERIMENT_LABEL].as_string()
    named = session.scalars(select(label).where(Job.team == team, label.is_not(None)).distinct())
    return {team, *(str(n) for n in named if n)}


def flatten(spec: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``resources.device_type``-style keys with string values; lists as JSON, unset (None) fields left out."""
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten(value, f"{name}.")
        elif isinstance(value, list):
            yield name, json.dumps(value, sort_keys=True)
        elif value is not None:
            yield name, str(value)


def _tags(job: Job, team: str) -> dict[str, str]:
    tags = {
        "mlflow.runName": job.name or job.id,
        "mlflow.user": team,
        "mlflow.source.type": "JOB",
        "mlflow.source.name": f"llmjobs:{job.kind}",
        "llmjobs.job_id": job.id,
        "llmjobs.kind": job.kind,
        "llmjobs.state": job.state,
    }
    optional = {"llmjobs.name": job.name, "llmjobs.parent_id": job.parent_id, "llmjobs.error_code": job.error_code}
    tags.update({k: v for k, v in optional.items() if v})
    tags.update({k: str(v) for k, v in (job.meta or {}).items() if not str(k).startswith("mlflow.")})
    return tags


def metric_number(value: float | None, special: str | None = None) -> float | str:
    """A metric value as MLflow's JSON carries it: non-finite ones as the strings NaN / Infinity / -Infinity."""
    if value is None:
        return special or "NaN"
    if math.isnan(value):
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def point_json(key: str, value: float | None, timestamp: int, step: int, special: str | None = None) -> dict[str, Any]:
    return {"key": key, "value": metric_number(value, special), "timestamp": timestamp, "step": step}


def _latest_points(session: Session, job_ids: list[str]) -> dict[str, list[MetricPoint]]:
    """Each job's newest job-wide point of each metric name."""
    out: dict[str, list[MetricPoint]] = {}
    for at in range(0, len(job_ids), CHUNK):
        chunk = job_ids[at : at + CHUNK]
        newest = (
            select(func.max(MetricPoint.id))
            .where(MetricPoint.job_id.in_(chunk), MetricPoint.rank.is_(None))
            .group_by(MetricPoint.job_id, MetricPoint.name)
        )
        for point in session.scalars(select(MetricPoint).where(MetricPoint.id.in_(newest))):
            out.setdefault(point.job_id, []).append(point)
    return out


def job_views(session: Session, team: str, jobs: list[Job], experiment_ids: dict[str, str]) -> list[RunView]:
    """``experiment_ids``: experiment name -> its id (every experiment these jobs name)."""
    latest = _latest_points(session, [job.id for job in jobs])
    views = []
    for job in jobs:
        points = sorted(latest.get(job.id, []), key=lambda p: p.name)
        start = millis(job.started_at or job.created_at)
        attributes = {
            "run_id": job.id,
            "run_uuid": job.id,
            "run_name": job.name or job.id,
            "experiment_id": experiment_ids[experiment_of(job, team)],
            "user_id": team,
            "status": _STATUS.get(job.state, "RUNNING"),
            "start_time": start,
            "end_time": millis(job.finished_at),
            "artifact_uri": f"mlflow-artifacts:/jobs/{job.id}/artifacts",
            "lifecycle_stage": "active",
        }
        views.append(
            RunView(
                attributes={k: v for k, v in attributes.items() if v is not None},
                metrics={p.name: float("nan") if p.value is None else p.value for p in points},
                params=dict(flatten({k: v for k, v in (job.spec or {}).items() if k != "metadata"})),  # labels are tags
                tags=_tags(job, team),
                metric_json=[point_json(p.name, p.value, millis(p.time) or 0, p.step) for p in points],
            )
        )
    return views
