"""The reconciler: one pass of recovery, pipeline advancing, scheduling, start deadlines and re-sent lost messages."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update

from core.db import session_scope
from core.disk_watch import warn_running
from core.dispatch import send_waiting
from core.host_verdicts import ServiceWatch, Verdicts, judge_hosts, presence_grace_s
from core.jobs import transition
from core.models import START_DEADLINE_SPECS, Job, JobSpec, utcnow
from core.pipelines import advance_all
from core.recovery import end_attempt, recover
from core.scheduler import fill_resources, schedule
from core.settings import Settings
from core.states import WAITING, JobState


def reconcile_once(settings: Settings, judge_hosts: bool = True) -> int:
    """Recover (dead hosts, lost nodes, cancels), schedule (which also writes pending reasons), enforce start
    deadlines, wake workers for jobs still waiting. Returns the number of messages re-sent. ``judge_hosts=False``:
    no host is marked down by its heartbeat age in this pass (see ``core.leadership.Leadership.led_for``)."""
    recover(settings, judge_hosts)
    warn_running(settings)  # running jobs whose data root is below disk_warn_below_bytes: a disk_low event each
    advance_all(settings)  # pipelines whose step ended where no worker advanced them (lost host, deadline, cancel)
    with session_scope(settings.database_url) as session:
        fill_resources(session)  # rows an older replica inserted, before the pass reads by resources
    schedule(settings)
    now = utcnow()
    expired, queues = _waiting(settings, now)
    for job_id, deadline, reason in expired:
        with session_scope(settings.database_url) as session:
            transition(
                session,
                job_id,
                JobState.failed,
                only_from=WAITING,
                error_code="start_deadline_exceeded",
                error_message=f"not started within start_deadline_s={deadline}: {reason}",
                message="start deadline exceeded",
            )
    return sum(_wake(settings, queue, job_id, now) for queue, job_id in queues.items())


def _waiting(settings: Settings, now: datetime) -> tuple[list[tuple[str, Any, str | None]], dict[str, str]]:
    """Waiting jobs past their start deadline (id, deadline, pending reason), and per queue that needs a wake its
    first waiting job: a queue needs one when a job of it was never sent, or when its latest message (the newest
    ``dispatched_at`` of its waiting jobs) is older than ``redispatch_after_s``. This runs over every waiting job on
    every pass, so the database does the counting: one row per queue, not one per waiting job (at 1,000 hosts, 10,000
    waiting rows read with their specs were most of a reconciler pass), and only the specs that set a deadline."""
    waiting = Job.state.in_([s.value for s in WAITING])
    # a stored spec holds only the fields its user set (``spec_to_json``): a text match finds the few with a deadline
    # without decoding every spec's JSON, through the partial index of that match (named literally: migration 0017;
    # matching every waiting job's spec text was most of a pass at 10,000 waiting); the value read from those decides
    columns = (Job.id, Job.state, JobSpec.spec["start_deadline_s"], Job.created_at, Job.updated_at, Job.pending_reason)
    expired: list[tuple[str, Any, str | None]] = []
    with session_scope(settings.database_url) as session:
        for job_id, state, deadline, created, updated, reason in session.execute(
            select(*columns)
            .join(JobSpec, JobSpec.job_id == Job.id)
            .where(waiting, START_DEADLINE_SPECS)
            .order_by(Job.created_at, Job.id)
        ):
            since = updated if state == JobState.retrying.value else created  # a retry waits anew
            if deadline and (now - since).total_seconds() > deadline:
                expired.append((job_id, deadline, reason))
        live = waiting & Job.id.notin_([e[0] for e in expired]) if expired else waiting
        stale = now - timedelta(seconds=settings.redispatch_after_s)
        per_queue = select(Job.queue, func.count(Job.id) - func.count(Job.dispatched_at), func.max(Job.dispatched_at))
        due = [
            queue
            for queue, never, latest in session.execute(per_queue.where(live).group_by(Job.queue))
            if never or latest is None or latest < stale
        ]
        first = {
            queue: session.scalar(
                select(Job.id).where(live, Job.queue == queue).order_by(Job.created_at, Job.id).limit(1)
            )
            for queue in due
        }
    return expired, {queue: job_id for queue, job_id in first.items() if job_id is not None}


def _wake(settings: Settings, queue: str, job_id: str, now: datetime) -> int:
    """One "job waits" message per queue: each one makes a worker run a whole scheduling pass (for every job), so one
    per queue does what one per job did, without N passes for N waiting jobs. On success the queue's jobs never sent
    and ``job_id`` (its first: the queue's latest message, see ``_waiting``) count as dispatched now; the others'
    rows are not rewritten (at 10,000 waiting jobs, restamping each every ``redispatch_after_s`` was most of the
    database's growth)."""
    if not send_waiting(settings, job_id, queue):
        return 0
    stands_for = (
        select(Job.id)
        .where(Job.queue == queue, Job.state.in_([s.value for s in WAITING]), Job.created_at <= now)
        .where(Job.dispatched_at.is_(None) | (Job.id == job_id))
        .with_for_update(skip_locked=True)  # never wait on a pass's rows (a deadlock); skipped ones are woken again
    )
    with session_scope(settings.database_url) as session:
        session.execute(
            update(Job)
            .where(Job.id.in_(stands_for))
            .values(dispatched_at=now)
            .execution_options(synchronize_session=False)
        )
    return 1


def service_watch(settings: Settings) -> ServiceWatch:
    """The watch of this process's host passes: a gap of a heartbeat interval (or five passes) means it fell behind."""
    return ServiceWatch(max(settings.heartbeat_interval_s, 5 * settings.presence_interval_s))


def watch_hosts(settings: Settings, watch: ServiceWatch, led_for: float = float("inf")) -> Verdicts:
    """One host pass (the leader's, every ``presence_interval_s``): absent workers go down once this process has
    watched long enough for every live worker to hold its presence again, silent ones once it has kept up for
    ``host_stale_after_s``; their nodes' attempts end (retryable). A fleet-wide heartbeat lag starts the watch over."""
    watch.tick()
    watched = min(led_for, watch.kept_up_for())
    verdicts = judge_hosts(
        settings, stale_ok=watched >= settings.host_stale_after_s, absent_ok=watched >= presence_grace_s(settings)
    )
    if verdicts.behind:
        watch.behind()
    for job_id, attempt, message in verdicts.ended:
        end_attempt(settings, job_id, attempt, retryable=True, error_code="node_lost", message=message)
    watch.tick()  # a pass that took longer than the gap (a starved database) counts as falling behind
    return verdicts
