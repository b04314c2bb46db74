"""The database side of Slurm pools' jobs: which to submit, which to track, and each job's move when Slurm's state
changes (``core.slurm.states``). Every move is a compare-and-set through ``core.jobs.transition``, so a second agent,
a cancel racing a Slurm state or a re-read after a restart changes nothing that was already decided."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update

from core.db import session_scope
from core.jobs import add_event, transition
from core.models import Attempt, Job, utcnow
from core.settings import Settings
from core.slurm.states import FINAL
from core.states import ACTIVE, RUNNING, WAITING, JobState

SUBMITTED = "SUBMITTED"  # slurm_state between sbatch's answer and the first read of the queue
# jobs.resources is the spec's resources as JSON text (json.dumps): every job has "pool", only a pool's job a string
POOL_MARK = '"pool": "'
CANCEL_STATES = (JobState.cancelling.value, JobState.cancelled.value)


@dataclass(frozen=True)
class SlurmRow:
    job_id: str
    state: str
    attempt: int
    slurm_job_id: str | None
    slurm_state: str | None
    run_dir: str
    team: str
    spec: dict[str, Any]
    pending_reason: str | None


def _row(job: Job) -> SlurmRow:
    return SlurmRow(
        job.id,
        job.state,
        job.attempt_count,
        job.slurm_job_id,
        job.slurm_state,
        job.run_dir,
        job.team,
        job.spec,
        job.pending_reason,
    )


def to_submit(settings: Settings, limit: int = 100) -> list[SlurmRow]:
    """Waiting pool jobs that have no Slurm job yet, oldest first."""
    with session_scope(settings.database_url) as session:
        jobs = session.scalars(
            select(Job)
            .where(
                Job.state.in_([s.value for s in WAITING]),
                Job.slurm_job_id.is_(None),
                Job.kind != "pipeline",  # its steps run as jobs of their own
                Job.resources.contains(POOL_MARK),
            )
            .order_by(Job.priority.desc(), Job.created_at)
            .limit(limit)
        )
        return [_row(job) for job in jobs if json.loads(job.resources or "{}").get("pool")]


def live(settings: Settings) -> list[SlurmRow]:
    """The jobs whose Slurm job has not reached a final state (``ix_jobs_slurm_live``)."""
    with session_scope(settings.database_url) as session:
        jobs = session.scalars(select(Job).where(Job.slurm_job_id.is_not(None), Job.slurm_state.not_in(sorted(FINAL))))
        return [_row(job) for job in jobs]


def record_submitted(settings: Settings, job_id: str, slurm_job_id: str) -> bool:
    """The Slurm job id on the job, if it still waits and has none (False: cancelled meanwhile; scancel it)."""
    with session_scope(settings.database_url) as session:
        moved = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.slurm_job_id.is_(None), Job.state.in_([s.value for s in WAITING]))
            .values(
                slurm_job_id=slurm_job_id,
                slurm_state=SUBMITTED,
                pending_reason=f"submitted to Slurm as job {slurm_job_id}",
                updated_at=utcnow(),
            )
            .execution_options(synchronize_session=False)
        )
        if moved.rowcount != 1:  # type: ignore[attr-defined]
            return False
        add_event(
            session, job_id, "slurm", f"submitted to Slurm as job {slurm_job_id}", data={"slurm_job_id": slurm_job_id}
        )
        return True


def set_slurm_state(settings: Settings, job_id: str, slurm_state: str) -> None:
    with session_scope(settings.database_url) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(slurm_state=slurm_state[:32])
            .execution_options(synchronize_session=False)
        )


def wait(settings: Settings, row: SlurmRow, reason: str) -> None:
    """Slurm holds the job: a running attempt was requeued (-> retrying), a waiting one keeps Slurm's reason."""
    with session_scope(settings.database_url) as session:
        if JobState(row.state) in RUNNING:
            transition(
                session,
                row.job_id,
                JobState.retrying,
                only_from=RUNNING,
                message=f"Slurm requeued job {row.slurm_job_id}; it resumes from its last checkpoint",
            )
            return
        text = f"Slurm: {reason}" if reason and reason != "None" else "Slurm: pending"
        if JobState(row.state) in WAITING and text != row.pending_reason:
            session.execute(
                update(Job)
                .where(Job.id == row.job_id, Job.state.in_([s.value for s in WAITING]))
                .values(pending_reason=text)
                .execution_options(synchronize_session=False)
            )


def start(settings: Settings, row: SlurmRow, nodes: str) -> int | None:
    """waiting -> starting: a new attempt on ``nodes``; returns its number (None: the job was not waiting)."""
    with session_scope(settings.database_url) as session:
        if not transition(
            session,
            row.job_id,
            JobState.starting,
            only_from=WAITING,
            message=f"Slurm job {row.slurm_job_id} started on {nodes}",
            attempt_count=Job.attempt_count + 1,
            host=nodes[:255] or None,
            dispatched_at=utcnow(),
            heartbeat_at=utcnow(),
        ):
            return None
        attempt = session.scalar(select(Job.attempt_count).where(Job.id == row.job_id))
        assert attempt is not None
        session.add(Attempt(job_id=row.job_id, number=attempt, host=nodes[:255] or None))
        return attempt


def run(settings: Settings, row: SlurmRow) -> bool:
    with session_scope(settings.database_url) as session:
        return transition(
            session, row.job_id, JobState.running, only_from=[JobState.starting], message="running under Slurm"
        )


def _end(
    settings: Settings, row: SlurmRow, state: JobState, exit_code: int | None, outcome: str, **fields: Any
) -> bool:
    """Close the row's attempt with ``outcome`` and move the job to the terminal ``state``, in one transaction."""
    with session_scope(settings.database_url) as session:
        session.execute(
            update(Attempt)
            .where(Attempt.job_id == row.job_id, Attempt.number == row.attempt, Attempt.finished_at.is_(None))
            .values(exit_code=exit_code, finished_at=utcnow(), outcome=outcome)
            .execution_options(synchronize_session=False)
        )
        return transition(session, row.job_id, state, only_from=[*WAITING, *ACTIVE], **fields)


def succeed(settings: Settings, row: SlurmRow, result: dict[str, Any]) -> bool:
    message = f"{result.get('kind', 'job')} succeeded (Slurm job {row.slurm_job_id})"
    return _end(settings, row, JobState.succeeded, 0, "ok", result=result, message=message)


def fail(
    settings: Settings,
    row: SlurmRow,
    *,
    error_code: str,
    message: str,
    exit_code: int | None = None,
    log_tail: str | None = None,
) -> bool:
    fields = {"error_code": error_code, "error_message": message, "error_log_tail": log_tail, "message": message}
    return _end(settings, row, JobState.failed, exit_code, "error", **fields)


def cancelled(settings: Settings, row: SlurmRow) -> bool:
    """cancelled, whatever the job was (a cancel through the API, or scancel by the cluster's users)."""
    message = f"Slurm job {row.slurm_job_id} cancelled"
    return _end(settings, row, JobState.cancelled, None, "cancelled", message=message)
