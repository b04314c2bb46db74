"""Job records: creation with idempotency, compare-and-set transitions, cancel, queries.

Every state change is one ``UPDATE jobs ... WHERE id = :id AND state IN (:allowed)``; the caller learns from the row
count whether it won. The transition writes a ``state`` event in the same transaction, so the event feed and the SSE
stream carry every change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.auth import Principal, load_visible
from core.errors import ApiError
from core.models import Event, Job, ServedName, new_id, utcnow
from core.pages import fetch_page
from core.settings import Settings
from core.states import ALLOWED_FROM, TERMINAL, WAITING, JobState
from core.stored_spec import stored_spec
from core.structured_logs import current_request_id
from engine.contract.spec import JobBase, ServeSpec, spec_to_json


def body_hash(raw: Any) -> str:
    """Hash of the request body's JSON value (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def find_by_key(session: Session, team: str, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.team == team, Job.idempotency_key == key))


def _replay(existing: Job, digest: str) -> Job:
    if existing.body_hash != digest:
        raise ApiError(
            409,
            "idempotency_conflict",
            "Idempotency-Key was already used with a different request body",
            "Idempotency-Key",
        )
    return existing


def create_job(
    session: Session,
    *,
    settings: Settings,
    team: str,
    spec: JobBase,
    raw: Any,
    idempotency_key: str | None = None,
    parent_id: str | None = None,
    retried: bool = False,
) -> tuple[Job, bool]:
    """Insert a queued job and commit. Returns ``(job, created)``; a replayed Idempotency-Key returns the first job.

    A serve job's names go into ``served_names`` in the same transaction, whose key (team, name) makes two
    deployments submitted at once unable to both take a name: the loser's insert fails and it gets the same 409 as
    the check read before it."""
    digest = body_hash(raw)
    if idempotency_key and (existing := find_by_key(session, team, idempotency_key)):
        return _replay(existing, digest), False
    if isinstance(spec, ServeSpec):
        check_served_names(session, team, spec)
    job_id = new_id()
    body = spec_to_json(spec)
    job = Job(
        id=job_id,
        team=team,
        kind=body["kind"],
        name=spec.name,
        spec=body,
        meta=dict(spec.metadata),
        priority=spec.priority,
        parent_id=parent_id,
        idempotency_key=idempotency_key,
        body_hash=digest,
        queue=settings.queue_for(spec.resources.device_type),
        resources=json.dumps(body["resources"], sort_keys=True),
        run_dir=str(settings.runs_path / job_id),
        max_restarts=settings.default_max_restarts if spec.max_restarts is None else spec.max_restarts,
        state=JobState.queued.value,
        pending_reason="waiting for the message to reach a worker",
        request_id=current_request_id(),
    )
    session.add(job)
    try:
        session.flush()  # the row first: events and served names reference it
        if isinstance(spec, ServeSpec):
            session.add_all(_served_rows(team, spec, job.id))
        add_event(session, job.id, "state", "queued", data={"state": "queued"})
        session.commit()
    except IntegrityError:
        session.rollback()  # lost a race with the same Idempotency-Key, or for a served name
        existing = find_by_key(session, team, idempotency_key) if idempotency_key else None
        if existing is not None:
            return _replay(existing, digest), False
        if not isinstance(spec, ServeSpec):
            raise
        check_served_names(session, team, spec)  # the winner is committed now: 409 naming the field it took
        if retried:
            raise
        release_served_names(session, team, spec)  # names left by a job that ended outside ``transition``
        return create_job(
            session,
            settings=settings,
            team=team,
            spec=spec,
            raw=raw,
            idempotency_key=idempotency_key,
            parent_id=parent_id,
            retried=True,
        )
    return job, True


def _names_served(served: str | None, adapters: Iterable[str], name: str | None, job_id: str | None) -> dict[str, str]:
    """The ``model`` names a deployment answers (as ``core.deployments`` resolves them), each with its spec field."""
    base = served or name or job_id
    names = {base: "served_model_name" if served else "name"} if base else {}
    return {**names, **{adapter: f"lora_adapters.{adapter}" for adapter in adapters}}


def _served_rows(team: str, spec: ServeSpec, job_id: str) -> list[ServedName]:
    names = _names_served(spec.served_model_name, spec.lora_adapters, spec.name, job_id)
    return [ServedName(team=team, name=name, job_id=job_id) for name in names]


def release_served_names(session: Session, team: str, spec: ServeSpec) -> None:
    """Delete the rows of ``spec``'s names held by jobs that ended without ``transition`` (none live holds them:
    ``check_served_names`` passed), then commit."""
    names = list(_names_served(spec.served_model_name, spec.lora_adapters, spec.name, None))
    ended = select(Job.id).where(Job.state.in_([s.value for s in TERMINAL]))
    session.execute(
        delete(ServedName)
        .where(ServedName.team == team, ServedName.name.in_(names), ServedName.job_id.in_(ended))
        .execution_options(synchronize_session=False)
    )
    session.commit()


def check_served_names(session: Session, team: str, spec: ServeSpec) -> None:
    """409 naming the field when a name this deployment would answer to is one a live deployment of the team (queued,
    starting, running, restarting) already answers to: requests would go to one of them only."""
    mine = _names_served(spec.served_model_name, spec.lora_adapters, spec.name, None)
    live = select(Job).where(Job.team == team, Job.kind == "serve", Job.state.not_in([s.value for s in TERMINAL]))
    # adapters loaded into a running deployment (core.live_adapters) are in served_names only, not in its spec
    held = session.execute(
        select(ServedName.name, ServedName.job_id).where(
            ServedName.team == team,
            ServedName.name.in_(list(mine)),
            ServedName.job_id.in_(live.with_only_columns(Job.id)),
        )
    ).first()
    if held is not None:
        field = mine[held.name]
        raise ApiError(
            409,
            "conflict",
            f"{field}: {held.name!r} is already served by deployment {held.job_id} of your team; give another name, or "
            "unload or cancel it first",
            field,
        )
    for job in session.scalars(live):
        stored = stored_spec(job.spec)
        theirs = _names_served(stored.served_model_name, stored.lora_adapters, job.name, job.id)
        for name, field in mine.items():
            if name in theirs:
                raise ApiError(
                    409,
                    "conflict",
                    f"{field}: {name!r} is already served by deployment {job.id} of your team; give another name, or "
                    "cancel that deployment first",
                    field,
                )


def add_event(
    session: Session,
    job_id: str,
    type: str,
    message: str = "",
    *,
    level: str = "info",
    data: dict[str, Any] | None = None,
    attempt: int | None = None,
    time: datetime | None = None,
) -> None:
    session.add(
        Event(
            job_id=job_id,
            type=type,
            message=message,
            level=level,
            data=data or {},
            attempt=attempt,
            time=time or utcnow(),
        )
    )


def transition(
    session: Session,
    job_id: str,
    target: JobState,
    *,
    only_from: Iterable[JobState] | None = None,
    message: str = "",
    **values: Any,
) -> bool:
    """Compare-and-set ``job.state`` to ``target``; returns False (and changes nothing) if another writer won.

    Commits on success, so the broker message or signal that follows never sees an uncommitted state.
    """
    sources = set(ALLOWED_FROM[target]) & (set(only_from) if only_from is not None else set(JobState))
    now = utcnow()
    values = {"updated_at": now, **values}
    if target is JobState.running:
        values.setdefault("started_at", now)
    if target in TERMINAL:
        values.setdefault("finished_at", now)
        values.setdefault("pending_reason", None)
    if target in (JobState.starting, JobState.running):
        values.setdefault("pending_reason", None)
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.state.in_([s.value for s in sources]))
        .values(state=target.value, **values)
        .execution_options(synchronize_session=False)
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False
    add_event(
        session,
        job_id,
        "state",
        message or target.value,
        data={"state": target.value},
        level="error" if target is JobState.failed else "info",
    )
    if target in TERMINAL:  # an ended deployment's names are free again (the job's own rows; none for other kinds)
        session.execute(
            delete(ServedName).where(ServedName.job_id == job_id).execution_options(synchronize_session=False)
        )
    session.commit()
    return True


def request_cancel(session: Session, job: Job) -> Job:
    """Cancel a waiting job at once; ask the worker to stop an active one (``cancelling``)."""
    state = JobState(job.state)
    if state is JobState.cancelled or state is JobState.cancelling:
        return job
    if state in TERMINAL:
        raise ApiError(409, "job_finished", f"job {job.id} already {state.value}; nothing to cancel", None)
    if state in WAITING:
        transition(session, job.id, JobState.cancelled, only_from=WAITING, message="cancelled before it started")
    else:
        transition(session, job.id, JobState.cancelling, message="cancel requested")
    # The worker may have moved the job meanwhile (e.g. queued -> starting): re-read and retry once more.
    session.expire_all()
    fresh = session.get(Job, job.id)
    assert fresh is not None
    if (
        fresh.state not in (JobState.cancelled.value, JobState.cancelling.value)
        and not JobState(fresh.state).is_terminal()
    ):
        return request_cancel(session, fresh)
    return fresh


def get_visible_job(session: Session, job_id: str, principal: Principal) -> Job:
    """The job, if this principal's team owns it (an admin sees every team); otherwise 404 (never 403)."""
    return load_visible(session, Job, job_id, principal, "job")


# The columns a job list sorts by (?sort=name, ?sort=-finished_at); blanks (no name, not started yet) come last
# in either direction. The job id breaks ties, so (value, id) orders every row and the cursor stays one id.
SORTS: dict[str, Any] = {
    "created_at": Job.created_at,
    "updated_at": Job.updated_at,
    "started_at": Job.started_at,
    "finished_at": Job.finished_at,
    "name": Job.name,
    "state": Job.state,
    "kind": Job.kind,
    "priority": Job.priority,
    "host": Job.host,
    "attempt_count": Job.attempt_count,
}
NULLABLE_SORTS = {"started_at", "finished_at", "name", "host"}
DEFAULT_SORT = "-created_at"


def parse_sort(sort: str | None) -> tuple[str, bool]:
    """``name`` or ``-name`` -> (column key, descending); 422 naming the choices for anything else."""
    sort = (sort or DEFAULT_SORT).strip()
    key = sort.removeprefix("-")
    if key not in SORTS:
        raise ApiError(
            422,
            "validation_error",
            f"sort: unknown field {key!r}; use one of {', '.join(SORTS)} (prefix - for descending)",
            "sort",
        )
    return key, sort.startswith("-")


def _past(key: str, descending: bool, anchor: Job) -> ColumnElement[bool]:
    """The rows after ``anchor`` in the (blanks last, value, id) order of ``key``."""
    column, value = SORTS[key], getattr(anchor, key)
    later_id = Job.id < anchor.id if descending else Job.id > anchor.id
    if value is None:  # the anchor is a blank: only the blanks after it
        return and_(column.is_(None), later_id)
    later = or_(column < value if descending else column > value, and_(column == value, later_id))
    return or_(later, column.is_(None)) if key in NULLABLE_SORTS else later


def list_jobs(
    session: Session,
    *,
    principal: Principal,
    state: str | None = None,
    kind: str | None = None,
    name: str | None = None,
    metadata: dict[str, str] | None = None,
    parent_id: str | None = None,
    after: str | None = None,
    limit: int = 20,
    sort: str | None = None,
) -> tuple[list[Job], bool]:
    """Newest first unless ``sort`` says otherwise (SORTS); ``after`` is the last id of the previous page."""
    by, descending = parse_sort(sort)
    query = select(Job)
    if not principal.admin:
        query = query.where(Job.team == principal.team)
    if state:
        states = [s.strip() for s in state.split(",")]
        unknown = [s for s in states if s not in {v.value for v in JobState}]
        if unknown:  # like an unknown kind: a typo must not read as "no such jobs"
            raise ApiError(
                422,
                "validation_error",
                f"state: unknown state {unknown[0]!r}; use one or several "
                f"(comma-separated) of {', '.join(v.value for v in JobState)}",
                "state",
            )
        query = query.where(Job.state.in_(states))
    if kind:
        query = query.where(Job.kind == kind)
    if name:
        query = query.where(Job.name == name)
    if parent_id:
        query = query.where(Job.parent_id == parent_id)
    for key, value in (metadata or {}).items():
        query = query.where(Job.meta[key].as_string() == value)
    if after:
        anchor = session.get(Job, after)
        if anchor is None or not principal.sees(anchor.team):  # another team's id reads as unknown
            raise ApiError(400, "invalid_cursor", f"after: no job {after}", "after")
        query = query.where(_past(by, descending, anchor))
    column = SORTS[by]
    order = [column.desc(), Job.id.desc()] if descending else [column.asc(), Job.id.asc()]
    if by in NULLABLE_SORTS:
        order.insert(0, column.is_(None))  # false first: blanks last (portable, unlike NULLS LAST)
    return fetch_page(session, query.order_by(*order), limit)
