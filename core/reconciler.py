"""The reconciler: one pass of recovery, pipeline advancing, scheduling, start deadlines and re-sent lost messages."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from core.db import session_scope
from core.dispatch import dispatch
from core.jobs import transition
from core.models import Job, utcnow
from core.pipelines import advance_all
from core.recovery import recover
from core.scheduler import schedule
from core.settings import Settings
from core.states import WAITING, JobState


def reconcile_once(settings: Settings, judge_hosts: bool = True) -> int:
    """Recover (dead hosts, lost nodes, cancels), schedule (which also writes pending reasons), enforce start
    deadlines, wake workers for jobs still waiting. Returns the number of messages re-sent. ``judge_hosts=False``:
    no host is marked down by its heartbeat age in this pass (see ``core.leadership.Leadership.led_for``)."""
    recover(settings, judge_hosts)
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
            transition(
                session,
                job.id,
                JobState.failed,
                only_from=WAITING,
                error_code="start_deadline_exceeded",
                error_message=f"not started within start_deadline_s={job.spec['start_deadline_s']}: "
                f"{job.pending_reason}",
                message="start deadline exceeded",
            )
    sent = 0
    for job_id, queue in to_send:
        sent += dispatch(settings, job_id, queue)
    return sent
