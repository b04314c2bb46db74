"""Sending "run job X" messages, only after the job row has committed, and the reconciler that re-sends lost ones."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import select, update

from core.db import session_scope
from core.models import Job, utcnow
from core.jobs import transition
from core.settings import Settings
from core.states import WAITING, JobState

log = logging.getLogger(__name__)
RUN_JOB_TASK = "llmjobs.run_job"


def send_run_job(settings: Settings, job_id: str, queue: str) -> None:
    from core.messaging import get_celery  # config only; importing it does not start a worker

    get_celery(settings.broker_url).send_task(RUN_JOB_TASK, args=[job_id], queue=queue)


def dispatch(settings: Settings, job_id: str, queue: str) -> bool:
    """Run a scheduling pass (it leases devices for the committed job if they are free and messages its hosts);
    if the job still waits, send the "job X waits" message that wakes the workers' schedulers. False if the
    broker refused."""
    from core.scheduler import schedule

    try:
        if any(g.job_id == job_id for g in schedule(settings)):
            return True
    except Exception as err:  # noqa: BLE001 - the reconciler and the workers schedule again
        log.warning("scheduling pass for %s failed (will be retried): %s", job_id, err)
    try:
        send_run_job(settings, job_id, queue)
    except Exception as err:  # noqa: BLE001 - the reconciler retries
        log.warning("dispatch of %s failed (the reconciler will retry): %s", job_id, err)
        return False
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(dispatched_at=utcnow()))
    return True


def reconcile_once(settings: Settings) -> int:
    """Recover (dead hosts, lost nodes, cancels), schedule (which also writes pending reasons), enforce start
    deadlines, wake workers for jobs still waiting. Returns the number of messages re-sent."""
    from core.pipelines import advance_all
    from core.recovery import recover
    from core.scheduler import schedule

    recover(settings)
    advance_all(settings)  # pipelines whose step ended where no worker advanced them (lost host, deadline, cancel)
    schedule(settings)
    now = utcnow()
    stale = now - timedelta(seconds=settings.redispatch_after_s)
    with session_scope(settings.database_url) as session:
        waiting = list(session.scalars(select(Job).where(Job.state.in_([s.value for s in WAITING]))))
        to_send: list[tuple[str, str]] = []
        expired: list[Job] = []
        for job in waiting:
            deadline = job.spec.get("start_deadline_s")
            since = job.updated_at if job.state == JobState.retrying.value else job.created_at  # a retry waits anew
            if deadline and (now - since).total_seconds() > deadline:
                expired.append(job)
                continue
            if job.dispatched_at is None or job.dispatched_at < stale:
                to_send.append((job.id, job.queue))
    for job in expired:
        with session_scope(settings.database_url) as session:
            transition(session, job.id, JobState.failed, only_from=WAITING, error_code="start_deadline_exceeded",
                       error_message=f"not started within start_deadline_s={job.spec['start_deadline_s']}: "
                                     f"{job.pending_reason}", message="start deadline exceeded")
    sent = 0
    for job_id, queue in to_send:
        sent += dispatch(settings, job_id, queue)
    return sent
