"""What a job recorded, read back: events, metric points, log lines and artifacts, each as a cursor page."""

from __future__ import annotations

import bisect
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, func, or_, select
from sqlalchemy.orm import Session, aliased

from core.models import Artifact, Attempt, Event, Job, LogLine, MetricPoint
from core.pages import fetch_page


def events_page(
    session: Session, job_id: str, *, after: int, limit: int, types: list[str] | None = None
) -> tuple[list[Event], bool]:
    """Events after id ``after``, oldest first; only those of ``types`` when given."""
    query = select(Event).where(Event.job_id == job_id, Event.id > after)
    if types:
        query = query.where(Event.type.in_(types))
    return fetch_page(session, query.order_by(Event.id), limit)


def metrics_page(
    session: Session,
    job_id: str,
    *,
    since_step: int,
    names: list[str] | None,
    limit: int,
    after: tuple[int, int] | None = None,
) -> tuple[list[MetricPoint], bool]:
    """Points in (step, id) order. With ``after`` = the (step, id) of the previous page's last point, the next page
    starts right after it: no row is skipped or repeated whatever the limit. Without it, points of steps after
    ``since_step``, a page never ending inside a step unless one step fills it (kept for older clients)."""
    query = select(MetricPoint).where(MetricPoint.job_id == job_id, MetricPoint.step > since_step, ~redone(MetricPoint))
    if after is not None:
        step, point_id = after
        query = query.where(or_(MetricPoint.step > step, and_(MetricPoint.step == step, MetricPoint.id > point_id)))
    if names:
        query = query.where(MetricPoint.name.in_(names))
    rows, has_more = fetch_page(session, query.order_by(MetricPoint.step, MetricPoint.id), limit)
    if after is None and has_more and rows[0].step != rows[-1].step:
        rows = [r for r in rows if r.step != rows[-1].step]
    return rows, has_more


def redone(point: type[MetricPoint]) -> ColumnElement[bool]:
    """A point a later one of the same step, name and rank replaces: a step a retry did again (a resumed run
    restarts from its last checkpoint) shows once, as its latest attempt measured it. Device telemetry (``sys_*``)
    samples one step many times and is kept."""
    newer = aliased(MetricPoint)
    return and_(
        ~point.name.startswith("sys_"),
        exists().where(
            newer.job_id == point.job_id,
            newer.step == point.step,
            newer.name == point.name,
            or_(newer.rank == point.rank, and_(newer.rank.is_(None), point.rank.is_(None))),
            newer.id > point.id,
        ),
    )


def point_attempts(session: Session, job_id: str, points: list[MetricPoint]) -> list[int | None]:
    """The attempt each point was measured in: the last attempt started at or before it (None before any)."""
    starts = list(
        session.execute(
            select(Attempt.started_at, Attempt.number).where(Attempt.job_id == job_id).order_by(Attempt.started_at)
        ).tuples()
    )
    times = [when for when, _ in starts]
    return [starts[i - 1][1] if (i := bisect.bisect_right(times, p.time)) else None for p in points]


def logs_page(
    session: Session, job_id: str, *, stream: str, offset: int, limit: int, q: str | None = None
) -> tuple[list[LogLine], bool]:
    """Lines of one stream from line number ``offset`` on; with ``q`` only those containing it (any case, taken
    literally: % and _ are not wildcards)."""
    query = select(LogLine).where(LogLine.job_id == job_id, LogLine.stream == stream, LogLine.seq >= offset)
    if q:
        query = query.where(LogLine.text.icontains(q, autoescape=True))
    return fetch_page(session, query.order_by(LogLine.seq), limit)


def artifacts(session: Session, job_id: str) -> list[Artifact]:
    return list(session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name)))


def job_state(session: Session, job_id: str) -> str | None:
    return session.scalar(select(Job.state).where(Job.id == job_id))


def events_after(session: Session, job_id: str, after: int, limit: int) -> list[Event]:
    """Rows with an id above ``after`` in id order (the live stream's feeds read these three)."""
    return list(
        session.scalars(select(Event).where(Event.job_id == job_id, Event.id > after).order_by(Event.id).limit(limit))
    )


def metric_points_after(session: Session, job_id: str, after: int, limit: int) -> list[MetricPoint]:
    return list(
        session.scalars(
            select(MetricPoint)
            .where(MetricPoint.job_id == job_id, MetricPoint.id > after)
            .order_by(MetricPoint.id)
            .limit(limit)
        )
    )


def log_lines_after(session: Session, job_id: str, after: int, limit: int) -> list[LogLine]:
    return list(
        session.scalars(
            select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after).order_by(LogLine.id).limit(limit)
        )
    )


def train_progress(session: Session, job_ids: list[str]) -> dict[str, tuple[int, int, datetime]]:
    """``job_id -> (trained tokens, last step, time of that step)`` from the engine's per-iteration ``tokens`` metric
    (real, non-padding tokens of the global batch). A step logged again by a resumed attempt counts once."""
    if not job_ids:
        return {}
    per_step = (
        select(
            MetricPoint.job_id,
            MetricPoint.step,
            func.max(MetricPoint.value).label("tokens"),
            func.max(MetricPoint.time).label("time"),
        )
        .where(MetricPoint.job_id.in_(job_ids), MetricPoint.name == "tokens", MetricPoint.rank.is_(None))
        .group_by(MetricPoint.job_id, MetricPoint.step)
        .subquery()
    )
    query = select(
        per_step.c.job_id, func.sum(per_step.c.tokens), func.max(per_step.c.step), func.max(per_step.c.time)
    ).group_by(per_step.c.job_id)
    return {job_id: (int(tokens or 0), int(step), when) for job_id, tokens, step, when in session.execute(query)}


def latest_values(session: Session, job_id: str, names: list[str]) -> dict[str, tuple[int, float | None]]:
    """The last job-wide point of each named metric: name -> (step, value). One indexed backward scan per name, so
    a long run costs no more than a short one (the job list asks this for every row it shows)."""
    out: dict[str, tuple[int, float | None]] = {}
    for name in names:
        row = session.execute(
            select(MetricPoint.step, MetricPoint.value)
            .where(MetricPoint.job_id == job_id, MetricPoint.name == name, MetricPoint.rank.is_(None))
            .order_by(MetricPoint.step.desc(), MetricPoint.id.desc())
            .limit(1)
        ).first()
        if row is not None:
            out[name] = (row.step, row.value)
    return out


def last_step(session: Session, job_id: str) -> int | None:
    return session.scalar(
        select(MetricPoint.step).where(MetricPoint.job_id == job_id).order_by(MetricPoint.step.desc()).limit(1)
    )


def last_event_data(session: Session, job_id: str, type_: str) -> dict[str, Any] | None:
    """The data of the job's newest event of one type (e.g. the last ``progress``)."""
    return session.scalar(
        select(Event.data).where(Event.job_id == job_id, Event.type == type_).order_by(Event.id.desc()).limit(1)
    )


def latest_device_values(session: Session, job_id: str, scan: int = 400) -> dict[int, dict[str, float | None]]:
    """Each device's newest telemetry (``sys_*`` points, keyed by their device index), from the job's last ``scan``
    such points: the worker writes one line per device every few seconds, so that covers the last sample."""
    rows = session.execute(
        select(MetricPoint.rank, MetricPoint.name, MetricPoint.value)
        .where(MetricPoint.job_id == job_id, MetricPoint.rank.is_not(None), MetricPoint.name.startswith("sys_"))
        .order_by(MetricPoint.id.desc())
        .limit(scan)
    ).all()
    out: dict[int, dict[str, float | None]] = {}
    for rank, name, value in rows:
        if rank is not None:  # always, by the query; says so to the type checker
            out.setdefault(rank, {}).setdefault(name, value)  # newest first: the first seen wins
    return out
