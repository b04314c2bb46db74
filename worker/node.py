"""Run one node of one job attempt on this host: the devices and rendezvous come from its ``job_nodes`` row.

claim (assigned -> launching, a compare-and-set: a redelivered message finds the node taken and does nothing) ->
launch (torchrun with --nnodes/--node-rank/rendezvous for multi-node jobs, exactly the leased devices visible) ->
running (the job becomes running when every node is) -> watch (ingest on node 0, heartbeat, stop on cancel, on a
run deadline, or when another node failed the attempt) -> record the exit -> settle the job -> release the leases
once the processes are gone -> a scheduling pass for whoever waits for these devices.

A database outage does not stop the engine: the database steps of the launch (claim, running record) wait for it,
while the database is away the watch goes on (the run deadline still holds; a cancel is seen once it answers again),
the ingestor leaves its lines in the run files (worker.ingest), and once the engine has exited its outcome is
recorded when the database answers again (``until_stored``). Each wait is bounded by ``database_away_deadline_s``:
past it a launch is given up (the node stays taken; the lease sweep marks it lost, the job is retried) and a
finished node's exit is parked in its run directory (``worker.parked``), stored by the worker's heartbeat
(``finish_parked``) once the database answers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.exc import InterfaceError, OperationalError

from core.db import is_database_away, session_scope
from core.deployments import with_deployment_url
from core.jobs import transition
from core.models import Attempt, Job, JobNode, utcnow
from core.nodes import move_nodes
from core.paths import team_areas
from core.pipelines import advance_parent
from core.pubsub import notify
from core.recovery import end_attempt, is_retryable, settle_cancel
from core.scheduler import schedule
from core.settings import Settings
from core.states import NODE_STARTED, RUNNING, HostState, JobState, NodeState
from core.stored_spec import stored_spec
from engine.contract.runfiles import EXIT_BAD_INPUT, read_result
from engine.contract.spec import parse_spec
from worker.execute import log_tail, record_artifacts, write_spec
from worker.hosts import set_host_state
from worker.ingest import RunIngestor
from worker.launcher import LaunchPlan, Rendezvous, build_launch
from worker.leases import (
    NODE_ENV,
    RUNNING_HERE,
    delete_leases,
    node_token,
    processes_gone,
    release_node,
    running_here,
)
from worker.parked import ParkedExit, park, read_parked, unpark
from worker.supervisor import Supervised
from worker.telemetry import start_telemetry

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a watch round or a best-effort pass shrugs off: the database is away, or refused this once (a deadlock).
UNANSWERED = (OperationalError, InterfaceError)


class DatabaseStillAway(Exception):
    """The database stayed away past the worker's deadline (``database_away_deadline_s``)."""


@dataclass
class NodeWork:
    node_id: int
    job_id: str
    attempt: int
    node_rank: int
    nnodes: int
    spec: dict[str, Any]
    run_dir: Path
    devices: list[int]
    master_addr: str
    master_port: int
    team: str = ""


def claim_node(
    settings: Settings, job_id: str, attempt: int, node_rank: int, host: str, claimed_at: datetime | None = None
) -> NodeWork | None:
    """assigned -> launching for this host's node of the current attempt, else None (duplicate or stale message).

    A retry passes the first try's ``claimed_at``: a claim that committed but whose answer was lost finds the node
    launching under this process and that start time, and takes it, instead of taking it for a duplicate."""
    claimed_at = claimed_at or utcnow()
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        if job is None or job.attempt_count != attempt or job.state not in RUNNING:
            return None
        claimed = move_nodes(
            session,
            NodeState.launching,
            JobNode.job_id == job_id,
            JobNode.attempt == attempt,
            JobNode.node_rank == node_rank,
            JobNode.host == host,
            worker_pid=os.getpid(),
            started_at=claimed_at,
            heartbeat_at=utcnow(),
        )
        this = (JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.node_rank == node_rank)
        if claimed != 1:
            ours = (JobNode.state == NodeState.launching.value, JobNode.worker_pid == os.getpid())
            if session.scalar(select(JobNode.id).where(*this, *ours, JobNode.started_at == claimed_at)) is None:
                return None
        return node_work(job, session.scalars(select(JobNode).where(*this)).one())


def node_work(job: Job, node: JobNode) -> NodeWork:
    return NodeWork(
        node.id,
        job.id,
        node.attempt,
        node.node_rank,
        stored_spec(job.spec).resources.nnodes,
        job.spec,
        Path(job.run_dir),
        list(node.devices),
        node.master_addr,
        node.master_port,
        job.team,
    )


def node_plan(work: NodeWork, settings: Settings | None = None) -> LaunchPlan:
    """The engine's command line and environment for this node; with ``settings``, the job's team areas too (the
    engine re-checks every path inside them right before opening it, ``engine.contract.guard``)."""
    spec = parse_spec(work.spec)
    rdzv = Rendezvous(work.master_addr, work.master_port, work.node_rank) if work.nnodes > 1 else None
    devices = work.devices if spec.resources.device_type != "cpu" else None
    plan = build_launch(spec, work.run_dir, job_id=work.job_id, devices=devices, rendezvous=rdzv)
    plan.env[NODE_ENV] = node_token(work.job_id, work.attempt, work.node_rank)  # how leases.py finds them all
    plan.env["LLMJOBS_NODE_RANK"] = str(work.node_rank)
    plan.env["LLMJOBS_DEVICES"] = ",".join(str(d) for d in work.devices)  # on CPU: the leased slots
    if settings is not None:
        plan.env.update(team_areas(settings, work.team).env())
    return plan


def _log_path(work: NodeWork) -> Path:
    name = "launcher.log" if work.node_rank == 0 else f"launcher-node{work.node_rank}.log"
    return work.run_dir / "logs" / name


def mark_running(settings: Settings, work: NodeWork, pid: int, argv: list[str], host: str) -> None:
    """launching -> running, the attempt's record (node 0), the job running once every node is. Idempotent: a retry
    after a commit whose answer was lost changes nothing."""
    with session_scope(settings.database_url) as session:
        move_nodes(session, NodeState.running, JobNode.id == work.node_id, pid=pid, heartbeat_at=utcnow())
        recorded = select(Attempt.id).where(Attempt.job_id == work.job_id, Attempt.number == work.attempt)
        if work.node_rank == 0 and session.scalar(recorded) is None:
            session.add(Attempt(job_id=work.job_id, number=work.attempt, host=host, pid=pid, argv=argv))
    promote_if_all_running(settings, work)


def promote_if_all_running(settings: Settings, work: NodeWork) -> bool:
    """starting -> running once every node of the attempt runs (a gang is running only as a whole)."""
    with session_scope(settings.database_url) as session:
        states = list(
            session.scalars(select(JobNode.state).where(JobNode.job_id == work.job_id, JobNode.attempt == work.attempt))
        )
        if len(states) != work.nnodes or any(s != NodeState.running.value for s in states):
            return False
        job = session.get(Job, work.job_id)
        if job is None or job.attempt_count != work.attempt:
            return False
        return transition(
            session,
            work.job_id,
            JobState.running,
            only_from=[JobState.starting],
            message=f"running on {work.nnodes} node(s)",
        )


def _job_view(settings: Settings, work: NodeWork, beat: bool) -> tuple[str, int]:
    with session_scope(settings.database_url) as session:
        if beat:
            session.execute(update(JobNode).where(JobNode.id == work.node_id).values(heartbeat_at=utcnow()))
            session.execute(
                update(Job)
                .where(Job.id == work.job_id, Job.attempt_count == work.attempt)
                .values(heartbeat_at=utcnow())
            )
        state, attempt = session.execute(select(Job.state, Job.attempt_count).where(Job.id == work.job_id)).one()
    return state, attempt


STOPPING = threading.Event()  # the worker shuts down: every node it runs stops its engine (``stop_engines``)


def shut_down(settings: Settings, host: str) -> None:
    """The worker shuts down, saying goodbye: mark its host down first (no scheduling pass grants it the retries; the
    next worker on it registers it up again), end at once the attempts of nodes it was sent but had not claimed (they
    would wait for the next worker), then stop its engines (each settles its attempt, ``worker_stopped``)."""
    try:
        if set_host_state(settings, host, HostState.down, pid=os.getpid()):
            release_unclaimed(settings, host)
    except Exception as err:  # noqa: BLE001 - the database may be away; stopping the engines matters more
        log.warning("could not mark host %s down on shutdown: %s", host, err)
    stop_engines()


def release_unclaimed(settings: Settings, host: str) -> int:
    """The attempts with a node assigned to ``host`` and not yet claimed end now as retryable (no backoff: the
    service stopped, not the job); returns how many ended."""
    with session_scope(settings.database_url) as session:
        waiting = session.execute(
            select(JobNode.job_id, JobNode.attempt, JobNode.node_rank)
            .where(JobNode.host == host, JobNode.state == NodeState.assigned.value)
            .distinct()
        ).all()
    ended = 0
    for job_id, attempt, rank in waiting:
        outcome = end_attempt(
            settings,
            job_id,
            attempt,
            retryable=True,
            error_code="worker_stopped",
            message=f"the worker on {host} stopped before it launched node {rank}",
        )
        ended += outcome != "superseded"
    return ended


def stop_engines() -> None:
    """The worker is shutting down (``llmjobs serve`` / ``make run`` stopped, SIGTERM): each node it runs stops its
    engine (SIGTERM, grace, SIGKILL) and ends its attempt as retryable, so the job resumes from its last checkpoint
    on the next start instead of training on with no API, and the restart costs that one attempt only."""
    STOPPING.set()


def watch_node(
    settings: Settings, work: NodeWork, proc: Supervised, ingestor: RunIngestor | None
) -> tuple[int, str | None]:
    """Until the engine exits or must stop; returns (exit code, stop reason or None)."""
    deadline = stored_spec(work.spec).run_deadline_s
    started = last_beat = time.monotonic()
    away_since: float | None = None
    while (code := proc.poll()) is None:
        if ingestor is not None:
            try:
                ingestor.poll()
            except Exception as err:  # noqa: BLE001 - offsets did not move; the next poll retries
                if ingestor.away_since is None or not is_database_away(err):
                    log.warning("ingest of %s failed, will retry: %s", work.job_id, err)
        now = time.monotonic()
        beat = away_since is not None or now - last_beat >= settings.heartbeat_interval_s  # beat at once when back
        try:
            state, attempt = _job_view(settings, work, beat)
            if state == JobState.starting.value and beat:
                promote_if_all_running(settings, work)
        except UNANSWERED as err:
            if away_since is None:
                away_since = now
                log.warning(
                    "job %s: the database is away (%s); the engine keeps running", work.job_id, type(err.orig).__name__
                )
            state, attempt = JobState.running.value, work.attempt  # as far as this node knows
        else:
            if away_since is not None:
                log.warning("job %s: the database answers again after %.1f s", work.job_id, now - away_since)
                away_since = None
            last_beat = now if beat else last_beat
        if state == JobState.cancelling.value:
            return proc.terminate(settings.cancel_grace_s), "cancelled"
        if attempt != work.attempt or state not in RUNNING:
            return proc.terminate(settings.cancel_grace_s), "superseded"  # another node failed the attempt
        if deadline and now - started > deadline:
            return proc.terminate(settings.cancel_grace_s), "run_deadline"
        if STOPPING.is_set():
            return proc.terminate(settings.cancel_grace_s), "worker_stopped"
        time.sleep(settings.ingest_interval_s)
    return code, None


def away_deadline(settings: Settings) -> float:
    """The monotonic time until which a step started now waits for the database."""
    return time.monotonic() + settings.database_away_deadline_s


def until_stored(what: str, step: Callable[[], T], give_up_at: float, max_delay_s: float = 10.0) -> T:
    """Run ``step`` (a database step of a launch, or a write after the engine exited) until the database takes it,
    backing off to ``max_delay_s``, while the database is away (``core.db.is_database_away``) and
    ``time.monotonic()`` is before ``give_up_at``; then raise ``DatabaseStillAway``. Any other error (integrity,
    programming, a deadlock) propagates at once. Each step is a compare-and-set or idempotent, so a retry after a
    commit whose answer was lost changes nothing."""
    delay, since = 0.5, time.monotonic()
    while True:
        try:
            return step()
        except Exception as err:
            if not is_database_away(err):
                raise
            now = time.monotonic()
            if now >= give_up_at:
                raise DatabaseStillAway(f"{what}: the database stayed away for {now - since:.0f} s") from err
            log.warning(
                "%s: the database is away (%s, %.0f s so far); retrying in %.1f s",
                what,
                type(getattr(err, "orig", err)).__name__,
                now - since,
                delay,
            )
            time.sleep(min(delay, give_up_at - now))
            delay = min(delay * 2, max_delay_s)


def record_exit(settings: Settings, work: NodeWork, code: int, stop: str | None) -> None:
    """The node's exit; with it its devices, once none of its processes lives (its stragglers killed): one new
    version of the node's row, where a release after the outcome wrote a second (issue 47). A node whose processes
    survive, or that was moved meanwhile (lost), keeps its leases for ``release_node``."""
    free = processes_gone(work.job_id, work.attempt, work.node_rank)
    with session_scope(settings.database_url) as session:
        now = utcnow()
        exited = move_nodes(
            session,
            NodeState.exited,
            JobNode.id == work.node_id,
            exit_code=code,
            finished_at=now,
            reason=stop,
            released_at=now if free else JobNode.released_at,
        )
        if exited and free:
            delete_leases(session, work.job_id, work.attempt, work.node_rank)
        if work.node_rank == 0:
            session.execute(
                update(Attempt)
                .where(Attempt.job_id == work.job_id, Attempt.number == work.attempt)
                .values(exit_code=code, finished_at=utcnow(), outcome=stop or ("ok" if code == 0 else "error"))
            )


def settle(settings: Settings, work: NodeWork, code: int, stop: str | None, error: dict[str, Any] | None) -> str:
    """Decide the job from this node's exit (the others decide from theirs; compare-and-set picks one winner)."""
    if stop == "cancelled" or stop == "superseded":
        settle_cancel(settings, work.job_id)
        return stop
    message = str((error or {}).get("message") or f"node {work.node_rank} exited with code {code}")
    tail = log_tail(work.run_dir)
    if stop == "worker_stopped":
        return end_attempt(
            settings,
            work.job_id,
            work.attempt,
            retryable=True,
            error_code="worker_stopped",
            message=f"the worker stopped (service shutdown) while node {work.node_rank} ran; "
            "the job resumes from its last checkpoint",
            log_tail=tail,
        )
    if stop == "run_deadline":
        return end_attempt(
            settings,
            work.job_id,
            work.attempt,
            retryable=False,
            error_code="run_deadline_exceeded",
            message=f"run deadline of {stored_spec(work.spec).run_deadline_s}s exceeded",
            log_tail=tail,
        )
    if code != 0:
        name = "bad_input" if code == EXIT_BAD_INPUT else ("killed" if code < 0 else "engine_error")
        if ((error or {}).get("data") or {}).get("code") == "disk_full":
            name = "disk_full"  # retryable (exit 75) once space returns; the previous checkpoint is intact
        return end_attempt(
            settings,
            work.job_id,
            work.attempt,
            retryable=is_retryable(settings, code),
            error_code=name,
            message=message,
            log_tail=tail,
        )
    return succeed_if_all_done(settings, work)


def succeed_if_all_done(settings: Settings, work: NodeWork) -> str:
    with session_scope(settings.database_url) as session:
        codes = list(
            session.scalars(
                select(JobNode.exit_code).where(
                    JobNode.job_id == work.job_id,
                    JobNode.attempt == work.attempt,
                    JobNode.state == NodeState.exited.value,
                )
            )
        )
        if len(codes) < work.nnodes or any(c != 0 for c in codes):
            return "waiting for the other nodes"
        result = read_result(work.run_dir)
        if result is None:
            return end_attempt(
                settings,
                work.job_id,
                work.attempt,
                retryable=False,
                error_code="no_result",
                message="the engine exited 0 without writing result.json",
                log_tail=log_tail(work.run_dir),
            )
        record_artifacts(settings, work.job_id, result.get("outputs") or {})
        ok = transition(
            session,
            work.job_id,
            JobState.succeeded,
            only_from=[JobState.starting, JobState.running, JobState.cancelling],
            result=result,
            message=f"{result.get('kind', 'job')} succeeded",
        )
    return "succeeded" if ok else "superseded"


def launch_failed(settings: Settings, work: NodeWork, err: Exception) -> str:
    log.exception("node %s of job %s failed to launch", work.node_rank, work.job_id)
    give_up_at = away_deadline(settings)
    until_stored(
        f"job {work.job_id}: exit record", lambda: record_exit(settings, work, -1, "launch_failed"), give_up_at
    )
    until_stored(f"job {work.job_id}: lease release", lambda: release_node(settings, work.node_id), give_up_at)
    return until_stored(
        f"job {work.job_id}: outcome",
        lambda: end_attempt(
            settings,
            work.job_id,
            work.attempt,
            retryable=True,
            error_code="launch_failed",
            message=f"node {work.node_rank} could not launch: {err}",
        ),
        give_up_at,
    )


def run_node(settings: Settings, job_id: str, attempt: int, node_rank: int, host: str) -> str:
    """The body of the ``llmjobs.run_node`` task; returns a short word for the task log. A worker shutting down
    claims nothing: the node stays assigned on a host marked down, so recovery re-queues the attempt, which started
    no process and so uses no restart (``core.recovery.end_attempt``)."""
    if STOPPING.is_set():
        log.info("node %s of attempt %s of %s: not claimed, the worker is shutting down", node_rank, attempt, job_id)
        return "skipped"
    with running_here(node_token(job_id, attempt, node_rank)):  # before the claim: a sweep never takes it for an orphan
        claimed_at = utcnow()
        work = until_stored(
            f"job {job_id}: claim",
            lambda: claim_node(settings, job_id, attempt, node_rank, host, claimed_at),
            away_deadline(settings),
        )
        return "skipped" if work is None else run_claimed(settings, work, host)


# Before an eval's launch gives up on the deployment it names (restarting after a lost host, or gone), it asks again
# after each of these waits: the attempt fails only then, so its retries are not all spent within seconds.
DEPLOYMENT_WAITS_S = (1.0, 2.0, 4.0, 8.0, 16.0)


def spec_with_deployment(settings: Settings, team: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``core.deployments.with_deployment_url``, asked again with backoff while the deployment is not ready."""
    for wait in (*DEPLOYMENT_WAITS_S, None):
        try:
            return with_deployment_url(settings, team, spec)
        except RuntimeError as err:
            if wait is None or STOPPING.is_set():
                raise
            log.info("%s; asking again in %.0f s", err, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")  # the last round returns or raises


def run_claimed(settings: Settings, work: NodeWork, host: str) -> str:
    """Launch, watch and finish a node this process has claimed."""
    job_id = work.job_id
    try:
        write_spec(work.run_dir, spec_with_deployment(settings, work.team, work.spec))
        ingestor = (
            RunIngestor(settings.database_url, job_id, work.run_dir, work.attempt, settings.redis_url)
            if work.node_rank == 0
            else None
        )
        plan = node_plan(work, settings)
        proc = Supervised(plan, _log_path(work))
    except Exception as err:  # noqa: BLE001 - a node that cannot start fails the attempt, and so stops the others
        return launch_failed(settings, work, err)
    telemetry = None
    try:
        telemetry = start_telemetry(
            work.run_dir,
            work.node_rank,
            stored_spec(work.spec).resources.device_type,
            work.devices,
            proc.pid,
            settings.telemetry_interval_s,
        )
        # The engine is already running (it needs no database): it writes its run files while this waits.
        until_stored(
            f"job {job_id}: running record",
            lambda: mark_running(settings, work, proc.pid, plan.argv, host),
            away_deadline(settings),
        )
        notify(settings.redis_url, job_id, state=1)
        advance_parent(settings, job_id)  # a pipeline runs once its step does
        code, stop = watch_node(settings, work, proc, ingestor)
    finally:
        if telemetry is not None:
            telemetry.stop()
        if proc.poll() is None:  # an exception above: never leave the engine running unsupervised
            proc.terminate(settings.cancel_grace_s)
    try:
        outcome = finish_node(settings, work, code, stop, ingestor, away_deadline(settings))
    except DatabaseStillAway as err:
        parked = ParkedExit(
            work.attempt,
            work.node_rank,
            code,
            stop,
            ingestor.offsets() if ingestor else None,
            ingestor.last_error if ingestor else None,
        )
        log.error(
            "%s; node %s's exit is parked in %s until it answers", err, work.node_rank, park(work.run_dir, parked)
        )
        return "parked"
    after_node(settings, job_id)
    return outcome


def finish_node(
    settings: Settings, work: NodeWork, code: int, stop: str | None, ingestor: RunIngestor | None, give_up_at: float
) -> str:
    """Everything after the engine exited: the final ingest, the exit record, the job's outcome, a cancel that raced
    the exit, the lease release. Each step waits for the database until ``give_up_at`` (``DatabaseStillAway``)."""
    job_id = work.job_id
    if ingestor is not None:
        until_stored(f"job {job_id}: final ingest", lambda: ingestor.poll(final=True), give_up_at)
    until_stored(f"job {job_id}: exit record", lambda: record_exit(settings, work, code, stop), give_up_at)
    outcome = until_stored(
        f"job {job_id}: outcome",
        lambda: settle(settings, work, code, stop, ingestor.last_error if ingestor else None),
        give_up_at,
    )
    until_stored(f"job {job_id}: cancel check", lambda: settle_cancel(settings, job_id), give_up_at)  # raced the exit
    until_stored(f"job {job_id}: lease release", lambda: release_node(settings, work.node_id), give_up_at)
    return outcome


def after_node(settings: Settings, job_id: str) -> None:
    """Announce the change, move the job's pipeline on and let the freed devices start a waiting job."""
    notify(settings.redis_url, job_id, state=1)
    advance_parent(settings, job_id)  # the next step of its pipeline, if it is one
    try:
        schedule(settings)
    except UNANSWERED as err:  # the reconciler and the host heartbeat schedule again
        log.warning("scheduling pass after job %s failed: %s", job_id, err)


def finish_parked(settings: Settings, host: str) -> int:
    """Store the parked exits (``worker.parked``) of this host's nodes that no task of this process runs: the
    database was away past the deadline when they ended, or this worker restarted since. One try each (the
    heartbeat calls again); returns how many were stored."""
    with session_scope(settings.database_url) as session:
        rows = session.execute(
            select(Job, JobNode)
            .join(JobNode, JobNode.job_id == Job.id)
            .where(
                JobNode.host == host,
                JobNode.released_at.is_(None),
                JobNode.state.in_([s.value for s in NODE_STARTED]),
            )
        ).all()
    stored = 0
    for work in (node_work(job, node) for job, node in rows):
        token = node_token(work.job_id, work.attempt, work.node_rank)
        with running_here(token):
            parked = read_parked(work.run_dir, work.attempt, work.node_rank)
            if parked is None or RUNNING_HERE[token] > 1:  # nothing parked, or a task of this process runs it
                continue
            try:
                stored += _store_parked(settings, work, parked)
            except Exception:  # noqa: BLE001 - one bad node must not keep the sweep from the others; logged loudly
                log.exception("job %s: storing node %s's parked exit failed", work.job_id, work.node_rank)
    return stored


def _store_parked(settings: Settings, work: NodeWork, parked: ParkedExit) -> int:
    ingestor = None
    if parked.offsets is not None:
        ingestor = RunIngestor(
            settings.database_url,
            work.job_id,
            work.run_dir,
            work.attempt,
            settings.redis_url,
            start_offsets=parked.offsets,
        )
        ingestor.last_error = parked.last_error
    try:
        outcome = finish_node(settings, work, parked.code, parked.stop, ingestor, give_up_at=time.monotonic())
    except DatabaseStillAway:
        if ingestor is not None:  # what the final ingest stored must not be stored again next time
            park(work.run_dir, replace(parked, offsets=ingestor.offsets(), last_error=ingestor.last_error))
        return 0
    unpark(work.run_dir, work.attempt, work.node_rank)
    log.warning("job %s: node %s's parked exit is stored: %s", work.job_id, work.node_rank, outcome)
    after_node(settings, work.job_id)
    return 1
