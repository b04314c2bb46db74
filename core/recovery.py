"""Recovery: end a failed attempt (re-queue it up to max_restarts, or fail the job), notice dead hosts, settle
cancels whose nodes are gone, re-send lost node messages. Run by the API's reconciler and by workers.

A job re-queued here keeps its spec and run directory, so the train engine resumes from the latest checkpoint under
``save`` on its next attempt.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.db import session_scope
from core.host_verdicts import judge_hosts
from core.jobs import transition
from core.messaging import send_run_node, waiting_in_queue
from core.models import Job, JobNode, Lease, utcnow
from core.nodes import move_nodes
from core.settings import Settings
from core.slurm.states import is_final
from core.states import NODE_STARTED, RUNNING, JobState, NodeState

log = logging.getLogger(__name__)


def is_retryable(settings: Settings, code: int | None) -> bool:
    """Exit codes from settings (75 and 1 by default), a signal death, or no exit code at all (a lost node)."""
    return code is None or code < 0 or code in settings.retry_exit_codes


def drop_unlaunched(session: Session, job_id: str, attempt: int) -> None:
    """Nodes of the attempt that never launched have no process: mark them dropped and free their devices now."""
    ranks = list(
        session.scalars(
            select(JobNode.node_rank).where(
                JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.state == NodeState.assigned.value
            )
        )
    )
    if not ranks:
        return
    now = utcnow()
    move_nodes(
        session,
        NodeState.dropped,
        JobNode.job_id == job_id,
        JobNode.attempt == attempt,
        JobNode.node_rank.in_(ranks),
        finished_at=now,
        released_at=now,
    )
    session.query(Lease).filter(Lease.job_id == job_id, Lease.attempt == attempt, Lease.node_rank.in_(ranks)).delete(
        synchronize_session=False
    )
    session.commit()


def end_attempt(
    settings: Settings,
    job_id: str,
    attempt: int,
    *,
    retryable: bool,
    error_code: str,
    message: str,
    log_tail: str | None = None,
) -> str:
    """The attempt failed: retrying (if retryable and restarts are left) or failed. 'superseded' if already decided.

    Only attempts that started a process count against ``max_restarts``: one whose nodes were all still waiting for
    their worker (a host restarted between the grant and the launch) is retried without using the budget, up to
    ``FREE_UNSTARTED_ATTEMPTS`` of them."""
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        if job is None or job.attempt_count != attempt or JobState(job.state) not in RUNNING:
            return "superseded"
        used = _attempts_started(session, job_id)
        free = attempt - used <= FREE_UNSTARTED_ATTEMPTS and not _started(session, job_id, attempt)
        counted = used if free else max(used, attempt - FREE_UNSTARTED_ATTEMPTS)
        if retryable and counted <= job.max_restarts:
            note = f"not counted: attempt {attempt} started no process; " if free else ""
            wait = 0.0 if free or error_code in SERVICE_STOPS else retry_backoff(settings, counted)
            not_before = utcnow() + timedelta(seconds=wait) if wait else None
            after = f"; next attempt after {not_before:%Y-%m-%d %H:%M:%S} UTC" if not_before else ""
            ok = transition(
                session,
                job_id,
                JobState.retrying,
                only_from=RUNNING,
                message=f"retrying: {message} ({note}{counted} of {job.max_restarts + 1} attempts used){after}",
                retry_not_before=not_before,
            )
            outcome = "retrying"
        else:
            if retryable:  # the last of its retries: say so, not "retrying"
                cause = message.removesuffix("; retrying")
                message = f"gave up after {counted} of {job.max_restarts + 1} attempts: {cause}"
            ok = transition(
                session,
                job_id,
                JobState.failed,
                only_from=RUNNING,
                error_code="retries_exhausted" if retryable and error_code not in NAMED_WHEN_EXHAUSTED else error_code,
                error_message=message,
                error_log_tail=log_tail,
                message=message,
            )
            outcome = "failed"
        if ok:
            drop_unlaunched(session, job_id, attempt)
    return outcome if ok else "superseded"


FREE_UNSTARTED_ATTEMPTS = 3
# Attempts the service ended, not the job (a worker shutting down stops its engines): no backoff, the job resumes as
# soon as a worker takes it again (its host is down until then).
SERVICE_STOPS = frozenset({"worker_stopped"})
# Retryable causes a person must act on: a job that gives up on them keeps their code (not retries_exhausted).
NAMED_WHEN_EXHAUSTED = frozenset({"disk_full"})


def retry_backoff(settings: Settings, failed: int) -> float:
    """Seconds a job waits for its next attempt after ``failed`` attempts that started a process: retry_backoff_s,
    doubled for each attempt after the first, at most retry_backoff_max_s. A cause that is gone for a while (a
    deployment an eval reads from, a host coming back) then costs one attempt, not every attempt within seconds."""
    if failed <= 0 or settings.retry_backoff_s <= 0:
        return 0.0
    return min(settings.retry_backoff_s * 2 ** min(failed - 1, 32), settings.retry_backoff_max_s)


def _started(session: Session, job_id: str, attempt: int) -> bool:
    """Whether a node of the attempt was ever claimed by its worker (``started_at`` is set on the claim)."""
    found = select(JobNode.id).where(
        JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.started_at.is_not(None)
    )
    return session.scalar(found.limit(1)) is not None


def _attempts_started(session: Session, job_id: str) -> int:
    """How many of the job's attempts started a process on some node."""
    started = select(func.count(func.distinct(JobNode.attempt))).where(
        JobNode.job_id == job_id, JobNode.started_at.is_not(None)
    )
    return int(session.scalar(started) or 0)


def settle_cancel(settings: Settings, job_id: str) -> bool:
    """cancelling -> cancelled once no node of the job is launching or running (their processes are gone)."""
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        if job is None or job.state != JobState.cancelling.value or job.kind == "pipeline":  # settled by its steps
            return False
        if job.slurm_job_id is not None and not is_final(job.slurm_state or ""):
            return False  # a Slurm pool's job: settled by the Slurm agent once Slurm says it ended (core.slurm)
        drop_unlaunched(session, job_id, job.attempt_count)
        busy = session.scalar(
            select(JobNode.id)
            .where(JobNode.job_id == job_id, JobNode.state.in_([s.value for s in NODE_STARTED]))
            .limit(1)
        )
        if busy is not None:
            return False
        return transition(
            session,
            job_id,
            JobState.cancelled,
            only_from=[JobState.cancelling],
            message="cancelled; every node has stopped",
        )


def mark_dead_hosts(settings: Settings) -> list[tuple[str, int, str]]:
    """Hosts judged down (a worker gone by its presence, or silent past host_stale_after_s: ``core.host_verdicts``);
    their active nodes are lost. Returns (job, attempt, message) to end.

    Their leases stay: only the host's worker can check that the processes are gone (it does when it comes back).
    """
    return judge_hosts(settings).ended


def resend_lost_messages(settings: Settings) -> int:
    """Nodes still 'assigned' after redispatch_after_s on a live host: their message was lost; send it again.
    Not where the host's queue still holds messages (``waiting_in_queue``, Redis): its worker is behind, not
    without its message (at 1,000 hosts under load, hundreds of such copies a pass took seconds to send and only
    doubled the queues). Their ``heartbeat_at`` (for an assigned node: when its message was last sent) is stamped
    in one statement."""
    stale = utcnow() - timedelta(seconds=settings.redispatch_after_s)
    with session_scope(settings.database_url) as session:
        nodes = session.execute(
            select(JobNode.id, JobNode.job_id, JobNode.attempt, JobNode.node_rank, JobNode.host).where(
                JobNode.state == NodeState.assigned.value, JobNode.heartbeat_at < stale
            )
        ).all()
        if not nodes:
            return 0
        behind = waiting_in_queue(settings, sorted({node.host for node in nodes})) or set()
        nodes = [node for node in nodes if node.host not in behind]
        ids = [node.id for node in nodes]
        for i in range(0, len(ids), 500):
            session.execute(
                update(JobNode)
                .where(JobNode.id.in_(ids[i : i + 500]), JobNode.state == NodeState.assigned.value)
                .values(heartbeat_at=utcnow())
                .execution_options(synchronize_session=False)
            )
    for node in nodes:
        try:
            send_run_node(settings, node.job_id, node.attempt, node.node_rank, node.host)
        except Exception as err:  # noqa: BLE001 - next pass retries
            log.warning("re-sending node %s of %s failed: %s", node.node_rank, node.job_id, err)
    return len(nodes)


def recover(settings: Settings, judge_hosts: bool = True) -> None:
    """One recovery pass (the reconciler calls it before scheduling). ``judge_hosts=False`` leaves hosts alone
    whatever their heartbeats say (a reconciler that has not watched them for host_stale_after_s yet)."""
    for job_id, attempt, message in mark_dead_hosts(settings) if judge_hosts else []:
        end_attempt(settings, job_id, attempt, retryable=True, error_code="node_lost", message=message)
    with session_scope(settings.database_url) as session:
        cancelling = list(session.scalars(select(Job.id).where(Job.state == JobState.cancelling.value)))
    for job_id in cancelling:
        settle_cancel(settings, job_id)
    resend_lost_messages(settings)
