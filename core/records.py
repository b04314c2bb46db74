"""What a job recorded, read back: events, metric points, log lines and artifacts, each as a cursor page."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.models import Artifact, Event, Job, LogLine, MetricPoint
from core.pages import fetch_page


def events_page(session: Session, job_id: str, *, after: int, limit: int) -> tuple[list[Event], bool]:
    """Events after id ``after``, oldest first."""
    query = select(Event).where(Event.job_id == job_id, Event.id > after).order_by(Event.id)
    return fetch_page(session, query, limit)


def metrics_page(session: Session, job_id: str, *, since_step: int, names: list[str] | None,
                 limit: int) -> tuple[list[MetricPoint], bool]:
    """Points of steps after ``since_step``, by step; a page never ends inside a step (unless one step fills it)."""
    query = select(MetricPoint).where(MetricPoint.job_id == job_id, MetricPoint.step > since_step)
    if names:
        query = query.where(MetricPoint.name.in_(names))
    rows, has_more = fetch_page(session, query.order_by(MetricPoint.step, MetricPoint.id), limit)
    if has_more and rows[0].step != rows[-1].step:
        rows = [r for r in rows if r.step != rows[-1].step]
    return rows, has_more


def logs_page(session: Session, job_id: str, *, stream: str, offset: int, limit: int) -> tuple[list[LogLine], bool]:
    """Lines of one stream from line number ``offset`` on."""
    query = (select(LogLine).where(LogLine.job_id == job_id, LogLine.stream == stream, LogLine.seq >= offset)
             .order_by(LogLine.seq))
    return fetch_page(session, query, limit)


def artifacts(session: Session, job_id: str) -> list[Artifact]:
    return list(session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name)))


def job_state(session: Session, job_id: str) -> str | None:
    return session.scalar(select(Job.state).where(Job.id == job_id))


def events_after(session: Session, job_id: str, after: int, limit: int) -> list[Event]:
    """Rows with an id above ``after`` in id order (the live stream's feeds read these three)."""
    return list(session.scalars(select(Event).where(Event.job_id == job_id, Event.id > after)
                                .order_by(Event.id).limit(limit)))


def metric_points_after(session: Session, job_id: str, after: int, limit: int) -> list[MetricPoint]:
    return list(session.scalars(select(MetricPoint).where(MetricPoint.job_id == job_id, MetricPoint.id > after)
                                .order_by(MetricPoint.id).limit(limit)))


def log_lines_after(session: Session, job_id: str, after: int, limit: int) -> list[LogLine]:
    return list(session.scalars(select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after)
                                .order_by(LogLine.id).limit(limit)))
