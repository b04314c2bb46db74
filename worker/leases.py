"""Giving devices back: a node's leases are released only once none of its processes is alive (checked, not assumed).

Every engine process carries ``LLMJOBS_NODE=<job id>:<attempt>:<node rank>`` in its environment (set by
``worker.node``; job ids are UUIDs, so it is unique across databases sharing a machine), so the check finds the
node's processes wherever they went: torchrun's workers start new sessions, and a killed worker's children are no
longer anyone's descendants. ``sweep_host`` runs when a worker starts and on every heartbeat: it kills what a
previous worker on this host left behind, marks those nodes lost, and releases the devices of finished nodes. A node
whose exit is parked (``worker.parked``: the engine ended while the database stayed away) is not lost: the sweep
leaves it to ``worker.node.finish_parked``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from core.db import session_scope
from core.models import Job, JobNode, Lease, utcnow
from core.nodes import move_nodes
from core.recovery import end_attempt
from core.settings import Settings
from core.states import NODE_ACTIVE, NODE_STARTED, NodeState
from worker.parked import parked_path

log = logging.getLogger(__name__)
NODE_ENV = "LLMJOBS_NODE"
KILL_WAIT_S = 10.0
RUNNING_HERE: Counter[str] = Counter()  # node token -> tasks of this worker process on it now (a duplicate counts)
_running_lock = threading.Lock()


@contextmanager
def running_here(token: str) -> Iterator[None]:
    """Mark the node as run by a task of this process while the block runs (the sweep leaves such nodes alone)."""
    with _running_lock:
        RUNNING_HERE[token] += 1
    try:
        yield
    finally:
        with _running_lock:
            RUNNING_HERE[token] -= 1


def node_token(job_id: str, attempt: int, node_rank: int) -> str:
    return f"{job_id}:{attempt}:{node_rank}"


def node_processes(token: str) -> list[psutil.Process]:
    """Live processes of this node on this host (zombies are dead: they hold no device)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(NODE_ENV) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_node_processes(token: str, wait_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL every process of the node and wait; returns the pids still alive afterwards (normally none)."""
    procs = node_processes(token)
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def release_node(settings: Settings, node_id: int) -> bool:
    """Release the node's leases if its processes are gone (killing stragglers first). False if some survive."""
    with session_scope(settings.database_url) as session:
        node = session.get(JobNode, node_id)
        if node is None or node.released_at is not None:
            return True
        survivors = kill_node_processes(node_token(node.job_id, node.attempt, node.node_rank))
        if survivors:
            node.reason = f"processes {survivors} survive SIGKILL; devices {node.devices} stay leased"
            log.error("node %s of job %s: %s", node.node_rank, node.job_id, node.reason)
            return False
        delete_leases(session, node.job_id, node.attempt, node.node_rank)
        node.released_at = utcnow()
    return True


def processes_gone(job_id: str, attempt: int, node_rank: int) -> bool:
    """Whether none of the node's processes lives, once its stragglers are killed: its devices may go back."""
    return not kill_node_processes(node_token(job_id, attempt, node_rank))


def delete_leases(session: Session, job_id: str, attempt: int, node_rank: int) -> None:
    """The node's devices back, in the caller's transaction (which sets the node's ``released_at``)."""
    session.execute(delete(Lease).where(Lease.job_id == job_id, Lease.attempt == attempt, Lease.node_rank == node_rank))


def sweep_host(settings: Settings, host: str, worker_pid: int | None = None) -> int:
    """Clean up nodes on ``host`` that no live task of this worker runs (a previous worker's, or one whose task died
    with an exception); returns how many were released."""
    worker_pid = os.getpid() if worker_pid is None else worker_pid
    with session_scope(settings.database_url) as session:
        nodes = session.execute(
            select(JobNode, Job.run_dir)
            .join(Job, Job.id == JobNode.job_id)
            .where(JobNode.host == host, JobNode.released_at.is_(None))
        ).all()
    released = 0
    for node, run_dir in nodes:
        token = node_token(node.job_id, node.attempt, node.node_rank)
        orphaned = node.state in NODE_STARTED and (node.worker_pid != worker_pid or RUNNING_HERE[token] <= 0)
        if node.state in NODE_ACTIVE and not orphaned:
            continue  # this worker runs it, or its message is still on the way
        if orphaned and parked_path(Path(run_dir), node.attempt, node.node_rank).is_file():
            continue  # it ended; its exit waits for finish_parked
        if orphaned:
            _mark_lost(settings, node)
        released += release_node(settings, node.id)
    return released


def _mark_lost(settings: Settings, node: JobNode) -> None:
    message = f"node {node.node_rank} lost: the worker on {node.host} (pid {node.worker_pid}) died while running it"
    with session_scope(settings.database_url) as session:
        move_nodes(
            session, NodeState.lost, JobNode.id == node.id, only_from=NODE_STARTED, finished_at=utcnow(), reason=message
        )
    end_attempt(settings, node.job_id, node.attempt, retryable=True, error_code="node_lost", message=message)
