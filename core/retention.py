"""Retention: what finished jobs keep, and for how long.

Settings give, per kind of record, how many days after a job finished its metric points, log lines, events and run
directory are kept (0 = forever). The job row itself, its result, attempts, artifacts list and webhook history stay.
Metric history of a finished job longer than ``metric_downsample_above`` points per series (metric name and rank)
is thinned to about that many, evenly spaced by step with the first and last kept (the dashboard downsamples on
read anyway; this bounds what is stored for long runs). ``collect`` does one pass: ``llmjobs gc`` runs it once, the
leading API replica every ``retention_interval_s``.

Events not yet fanned out to every enabled webhook (``id`` above the lowest cursor) are never deleted, and a run
directory is only removed if it lies inside ``runs_dir`` (a row pointing elsewhere is left alone).
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from core.db import session_scope
from core.models import Event, Job, LogLine, MetricPoint, Webhook, utcnow
from core.settings import Settings
from core.states import TERMINAL

log = logging.getLogger(__name__)
BATCH = 500  # jobs per delete statement


@dataclass
class Collected:
    metric_points: int = 0
    log_lines: int = 0
    events: int = 0
    run_dirs: int = 0
    downsampled_points: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def finished_before(session: Session, cutoff: datetime) -> list[str]:
    return list(
        session.scalars(
            select(Job.id).where(
                Job.state.in_([s.value for s in TERMINAL]), Job.finished_at.is_not(None), Job.finished_at < cutoff
            )
        )
    )


def _delete_for(
    session: Session, model: type[MetricPoint | LogLine | Event], job_ids: list[str], extra: object = None
) -> int:
    removed = 0
    for start in range(0, len(job_ids), BATCH):
        stmt = delete(model).where(model.job_id.in_(job_ids[start : start + BATCH]))
        if extra is not None:
            stmt = stmt.where(extra)  # type: ignore[arg-type]
        removed += session.execute(stmt.execution_options(synchronize_session=False)).rowcount  # type: ignore[attr-defined]
    return removed


def _cutoff(now: datetime, days: float) -> datetime | None:
    return now - timedelta(days=days) if days > 0 else None


def _prune_rows(settings: Settings, now: datetime, out: Collected) -> None:
    with session_scope(settings.database_url) as session:
        if cutoff := _cutoff(now, settings.retention_metric_points_days):
            out.metric_points = _delete_for(session, MetricPoint, finished_before(session, cutoff))
        if cutoff := _cutoff(now, settings.retention_log_lines_days):
            out.log_lines = _delete_for(session, LogLine, finished_before(session, cutoff))
        if cutoff := _cutoff(now, settings.retention_events_days):
            fanned = session.scalar(select(func.min(Webhook.cursor)).where(Webhook.disabled_at.is_(None)))
            out.events = _delete_for(
                session, Event, finished_before(session, cutoff), Event.id <= fanned if fanned is not None else None
            )


def _remove_run_dirs(settings: Settings, now: datetime, out: Collected) -> None:
    cutoff = _cutoff(now, settings.retention_run_dirs_days)
    if cutoff is None:
        return
    root = settings.runs_path.resolve()
    with session_scope(settings.database_url) as session:
        dirs = list(session.scalars(select(Job.run_dir).where(Job.id.in_(finished_before(session, cutoff)))))
    for raw in dirs:
        path = Path(raw).resolve()
        if path == root or not path.is_relative_to(root) or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        out.run_dirs += not path.exists()


def keep_indices(count: int, target: int) -> set[int]:
    """About ``target`` evenly spaced positions of ``count``, always the first and the last."""
    if count <= target:
        return set(range(count))
    stride = math.ceil(count / max(target - 1, 1))
    return set(range(0, count, stride)) | {count - 1}


def downsample(settings: Settings) -> int:
    """Thin every series of a finished job with more than ``metric_downsample_above`` points; returns points removed."""
    target = settings.metric_downsample_above
    if target <= 0:
        return 0
    removed = 0
    with session_scope(settings.database_url) as session:
        finished = select(Job.id).where(Job.state.in_([s.value for s in TERMINAL]))
        series = list(
            session.execute(
                select(MetricPoint.job_id, MetricPoint.name, MetricPoint.rank)
                .where(MetricPoint.job_id.in_(finished))
                .group_by(MetricPoint.job_id, MetricPoint.name, MetricPoint.rank)
                .having(func.count() > target)
            ).tuples()
        )
    for job_id, name, rank in series:
        with session_scope(settings.database_url) as session:
            same_rank = MetricPoint.rank.is_(None) if rank is None else MetricPoint.rank == rank
            ids = list(
                session.scalars(
                    select(MetricPoint.id)
                    .where(MetricPoint.job_id == job_id, MetricPoint.name == name, same_rank)
                    .order_by(MetricPoint.step, MetricPoint.id)
                )
            )
            keep = keep_indices(len(ids), target)
            drop = [point for i, point in enumerate(ids) if i not in keep]
            for start in range(0, len(drop), BATCH):
                session.execute(
                    delete(MetricPoint)
                    .where(MetricPoint.id.in_(drop[start : start + BATCH]))
                    .execution_options(synchronize_session=False)
                )
            removed += len(drop)
    return removed


def collect(settings: Settings, now: datetime | None = None) -> Collected:
    """One retention pass (idempotent: a second pass right after removes nothing)."""
    now, out = now or utcnow(), Collected()
    _prune_rows(settings, now, out)
    _remove_run_dirs(settings, now, out)
    out.downsampled_points = downsample(settings)
    if any(out.as_dict().values()):
        log.info("retention: removed %s", out.as_dict())
    return out
