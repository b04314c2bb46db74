"""Sending "run job X" messages, only after the job row has committed, and the reconciler that re-sends lost ones."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import func, select, update

from app.db import session_scope
from app.models import Host, Job, utcnow
from app.services.jobs import transition
from app.settings import Settings
from app.states import WAITING, JobState

log = logging.getLogger(__name__)
RUN_JOB_TASK = "llmjobs.run_job"


def send_run_job(settings: Settings, job_id: str, queue: str) -> None:
    from worker.celery_app import get_celery  # config only; importing it does not start a worker

    get_celery(settings.broker_url).send_task(RUN_JOB_TASK, args=[job_id], queue=queue)


def dispatch(settings: Settings, job_id: str, queue: str) -> bool:
    """Send the message for a committed job and stamp ``dispatched_at``; False if the broker refused."""
    try:
        send_run_job(settings, job_id, queue)
    except Exception as err:  # noqa: BLE001 - the reconciler retries
        log.warning("dispatch of %s failed (the reconciler will retry): %s", job_id, err)
        return False
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(dispatched_at=utcnow()))
    return True


def _pending_reason(settings: Settings, live: dict[str, int], job: Job) -> str:
    device_type = job.queue.rsplit(".", 1)[-1]
    if not live.get(device_type):
        return (f"no live worker serves queue {job.queue} (start one: llmjobs worker --device-type {device_type}); "
                f"hosts count as live for {settings.host_stale_after_s:.0f}s after a heartbeat")
    return f"waiting for a free slot on one of {live[device_type]} {device_type} worker(s)"


def reconcile_once(settings: Settings) -> int:
    """Re-send lost messages, explain why jobs wait, enforce start deadlines. Returns the number re-sent."""
    now = utcnow()
    stale = now - timedelta(seconds=settings.redispatch_after_s)
    with session_scope(settings.database_url) as session:
        live = dict(session.execute(
            select(Host.device_type, func.count()).where(
                Host.state == "up", Host.heartbeat_at > now - timedelta(seconds=settings.host_stale_after_s))
            .group_by(Host.device_type)).all())
        waiting = list(session.scalars(select(Job).where(Job.state.in_([s.value for s in WAITING]))))
        to_send: list[tuple[str, str]] = []
        expired: list[Job] = []
        for job in waiting:
            deadline = job.spec.get("start_deadline_s")
            if deadline and (now - job.created_at).total_seconds() > deadline:
                expired.append(job)
                continue
            reason = _pending_reason(settings, live, job)
            if reason != job.pending_reason:
                session.execute(update(Job).where(Job.id == job.id, Job.state == job.state).values(pending_reason=reason))
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
