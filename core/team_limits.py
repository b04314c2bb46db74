"""What one team may ask of the shared queue: at most ``team_max_active_jobs`` unfinished jobs (429 with Retry-After
past it) and priorities up to its ceiling (``team_priority_ceiling``, per-team ``team_priority_ceilings`` set by an
admin; 422 above it), so one team's backlog or priorities cannot push every other team's jobs back."""

from __future__ import annotations

import zlib
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from core.errors import ApiError, team_limit_reached
from core.jobs import find_by_key
from core.models import Job
from core.settings import Settings
from core.states import TERMINAL


def check_active_jobs(session: Session, settings: Settings, team: str, idempotency_key: str | None = None) -> None:
    """429 ``too_many_jobs`` when ``team`` already has its limit of jobs that have not finished (pipelines count
    once; their steps, created later by the service, do not). Call it in the transaction that creates the job: on
    PostgreSQL it holds a per-team lock until that commits, so concurrent submissions cannot overshoot the limit
    (SQLite admits the few that count at the same instant). A replay of an Idempotency-Key the team already used is
    never refused here: it creates nothing, and it is how a client learns the id of the job it made."""
    limit = settings.team_max_active_jobs
    if not limit or (idempotency_key and find_by_key(session, team, idempotency_key) is not None):
        return
    if session.get_bind().dialect.name == "postgresql":  # one submission of the team at a time counts and inserts
        key = zlib.crc32(f"llmjobs team jobs {team}".encode())
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})  # until the job's commit
    unfinished = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.team == team, Job.parent_id.is_(None), Job.state.not_in([s.value for s in TERMINAL]))
    )
    if unfinished is not None and unfinished >= limit:
        message = (
            f"team {team} has {unfinished} unfinished jobs, its limit (team_max_active_jobs); retry when some finish"
        )
        raise team_limit_reached("too_many_jobs", message, settings.team_limit_retry_after_s)


def check_priority(settings: Settings, team: str, raw: Any) -> None:
    """422 naming the field when the spec (or a pipeline step) asks a priority above ``team``'s ceiling."""
    ceiling = settings.priority_ceiling(team)
    specs = [("", raw)]
    if isinstance(raw, dict) and isinstance(raw.get("steps"), list):
        specs += [(f"steps.{i}.spec.", s.get("spec")) for i, s in enumerate(raw["steps"]) if isinstance(s, dict)]
    for where, spec in specs:
        priority = spec.get("priority") if isinstance(spec, dict) else None
        if isinstance(priority, int) and priority > ceiling:
            raise ApiError(
                422,
                "priority_too_high",
                f"{where}priority: {priority} is above team {team}'s ceiling of {ceiling} (set by an admin)",
                f"{where}priority",
            )
