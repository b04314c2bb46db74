"""Device scheduler: grants whole gangs of devices atomically, FIFO within a priority, priorities across.

One pass (``schedule``) is one transaction that first updates the single ``scheduler_lock`` row: on PostgreSQL that
row lock serialises concurrent schedulers (as SELECT ... FOR UPDATE would), on SQLite the first write takes the
database write lock (as BEGIN IMMEDIATE would). Any process may run a pass (the API on submit and in its reconciler,
every worker on start, after a job and on its heartbeat); the lock makes them safe, and ``uq_leases_host_device``
makes a double grant impossible even if it were not.

A grant inserts one lease row per device and one ``job_nodes`` row per node, moves the job queued/retrying ->
starting (attempt + 1) and, after the commit, sends each node's "run node" message to its host's queue. A job that
does not fit waits with a ``pending_reason``; it also holds back the later jobs of its device type (no backfill), so
a big gang job is never starved by small ones. A job that can never fit is refused at submission (``check_fits``).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.db import session_scope
from core.errors import ApiError
from core.jobs import add_event
from core.messaging import send_run_node
from core.models import Host, Job, JobNode, Lease, SchedulerLock, utcnow
from core.settings import Settings
from core.states import NODE_ACTIVE, WAITING, HostState, JobState, NodeState, sources
from engine.plan import DoesNotFit, check_registered_memory
from engine.spec import JobBase, Resources

log = logging.getLogger(__name__)


@dataclass
class HostView:
    name: str
    address: str
    free: list[int]
    total: int


@dataclass
class Grant:
    job_id: str
    attempt: int
    hosts: list[str] = field(default_factory=list)
    request_id: str | None = None


def lock(session: Session) -> None:
    """Serialise with every other scheduler until this transaction ends (see the module docstring)."""
    session.execute(
        update(SchedulerLock)
        .where(SchedulerLock.id == 1)
        .values(generation=SchedulerLock.generation + 1)
        .execution_options(synchronize_session=False)
    )


def host_ids(host: Host) -> list[int]:
    return list(host.device_ids) if host.device_ids is not None else list(range(host.devices))


def is_live(host: Host, settings: Settings) -> bool:
    return host.state == HostState.up.value and host.heartbeat_at > utcnow() - timedelta(
        seconds=settings.host_stale_after_s
    )


def live_hosts(session: Session, settings: Settings, device_type: str) -> list[HostView]:
    held: dict[str, set[int]] = {}
    for name, device in session.execute(select(Lease.host, Lease.device)):
        held.setdefault(name, set()).add(device)
    views = []
    for host in session.scalars(select(Host).where(Host.device_type == device_type).order_by(Host.name)):
        if is_live(host, settings):
            ids = host_ids(host)
            views.append(
                HostView(
                    host.name,
                    host.address or "127.0.0.1",
                    [d for d in ids if d not in held.get(host.name, set())],
                    len(ids),
                )
            )
    return views


def place(res: Resources, hosts: list[HostView]) -> list[tuple[HostView, list[int]]] | None:
    """``nnodes`` distinct hosts with ``nproc_per_node`` free devices each, fullest first (best fit), or None."""
    fitting = sorted((h for h in hosts if len(h.free) >= res.nproc_per_node), key=lambda h: (len(h.free), h.name))
    if len(fitting) < res.nnodes:
        return None
    return [(h, h.free[: res.nproc_per_node]) for h in fitting[: res.nnodes]]


def team_usage(session: Session) -> dict[str, int]:
    return {team: count for team, count in session.execute(select(Lease.team, func.count()).group_by(Lease.team))}


def _free_summary(hosts: list[HostView], limit: int = 5) -> str:
    parts = [f"host {h.name} has {len(h.free)} free" for h in hosts[:limit]]
    return "; ".join(parts) + (f"; {len(hosts) - limit} more hosts" if len(hosts) > limit else "")


def waiting_reason(res: Resources, hosts: list[HostView], settings: Settings) -> str:
    kind = res.device_type
    if not hosts:
        return (
            f"no live worker serves {kind} devices (start one: llmjobs worker --device-type {kind}); hosts count as "
            f"live for {settings.host_stale_after_s:.0f}s after a heartbeat"
        )
    if res.nnodes == 1:
        return f"waiting for {res.nproc_per_node} free {kind} devices on one host; {_free_summary(hosts)}"
    enough = sum(len(h.free) >= res.nproc_per_node for h in hosts)
    return (
        f"waiting for {res.nnodes} hosts with {res.nproc_per_node} free {kind} devices each ({enough} have enough); "
        f"{_free_summary(hosts)}"
    )


def choose_port(session: Session, settings: Settings, master: str, job_id: str, attempt: int) -> int:
    """A rendezvous port on node 0's host that no active job there uses; spread by job so retries rarely reuse one."""
    used = set(
        session.scalars(
            select(JobNode.master_port).where(
                JobNode.host == master, JobNode.node_rank == 0, JobNode.state.in_([s.value for s in NODE_ACTIVE])
            )
        )
    )
    start = zlib.crc32(f"{job_id}:{attempt}".encode()) % settings.rdzv_port_count
    for i in range(settings.rdzv_port_count):
        port = settings.rdzv_port_base + (start + i) % settings.rdzv_port_count
        if port not in used:
            return port
    raise RuntimeError(f"all {settings.rdzv_port_count} rendezvous ports on {master} are in use")


def grant(session: Session, settings: Settings, job: Job, placement: list[tuple[HostView, list[int]]]) -> Grant | None:
    """Lease the devices and move the job to ``starting``, inside the caller's locked transaction."""
    attempt, now = job.attempt_count + 1, utcnow()
    master = placement[0][0]
    started = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.state.in_(sources(JobState.starting)))
        .values(
            state=JobState.starting.value,
            attempt_count=attempt,
            host=master.name,
            pending_reason=None,
            updated_at=now,
            heartbeat_at=now,
            dispatched_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    if started.rowcount != 1:  # type: ignore[attr-defined]  # cancelled meanwhile
        return None
    port = choose_port(session, settings, master.name, job.id, attempt)
    for rank, (host, devices) in enumerate(placement):
        session.add_all(
            Lease(host=host.name, device=d, job_id=job.id, team=job.team, attempt=attempt, node_rank=rank)
            for d in devices
        )
        session.add(
            JobNode(
                job_id=job.id,
                attempt=attempt,
                node_rank=rank,
                host=host.name,
                devices=devices,
                master_addr=master.address,
                master_port=port,
                state=NodeState.assigned.value,
                heartbeat_at=now,
            )
        )
        host.free = [d for d in host.free if d not in devices]
    where = ", ".join(f"{h.name} {job.spec['resources']['device_type']} {d}" for h, d in placement)
    add_event(
        session,
        job.id,
        "state",
        f"starting attempt {attempt} on {where}",
        attempt=attempt,
        data={"state": "starting", "nodes": [{"host": h.name, "devices": d} for h, d in placement]},
    )
    return Grant(job.id, attempt, [h.name for h, _ in placement], job.request_id)


def behind_reason(count: int, kind: str) -> str:
    """Why a job waits behind others: how many, not whose (their ids may be other teams')."""
    return (
        f"waiting behind {count} job{'s' if count != 1 else ''} (higher priority or queued earlier) for {kind} devices"
    )


def _pass(session: Session, settings: Settings) -> list[Grant]:
    lock(session)
    waiting = Job.state.in_([s.value for s in WAITING]) & (Job.kind != "pipeline")  # a pipeline runs as its child jobs
    jobs = list(session.scalars(select(Job).where(waiting).order_by(Job.priority.desc(), Job.created_at, Job.id)))
    usage = team_usage(session)
    hosts: dict[str, list[HostView]] = {}
    blocked: dict[str, str] = {}
    ahead: dict[str, int] = {}  # waiting jobs queued before this one for a blocked device type (counted, never named)
    grants = []
    for job in jobs:
        res = Resources.model_validate(job.spec.get("resources") or {})
        kind = res.device_type
        if kind not in hosts:
            hosts[kind] = live_hosts(session, settings, kind)
        limit, held = settings.device_limit(job.team), usage.get(job.team, 0)
        if limit and held + res.world_size > limit:
            reason = f"team {job.team} holds {held} of its {limit} devices; this job needs {res.world_size}"
        elif kind in blocked:
            reason = behind_reason(ahead[kind], kind)
            ahead[kind] += 1
        elif (placement := place(res, hosts[kind])) is None:
            reason, blocked[kind], ahead[kind] = waiting_reason(res, hosts[kind], settings), job.id, 1
        elif (granted := grant(session, settings, job, placement)) is not None:
            usage[job.team] = held + res.world_size
            grants.append(granted)
            continue
        else:
            continue
        if reason != job.pending_reason:
            session.execute(
                update(Job)
                .where(Job.id == job.id, Job.state == job.state)
                .values(pending_reason=reason)
                .execution_options(synchronize_session=False)
            )
    return grants


def send_node_messages(settings: Settings, grant_: Grant) -> None:
    for rank, host in enumerate(grant_.hosts):
        send_run_node(settings, grant_.job_id, grant_.attempt, rank, host, grant_.request_id)


def schedule(settings: Settings) -> list[Grant]:
    """One scheduling pass; sends the granted nodes' messages after the commit. Returns the grants."""
    with session_scope(settings.database_url) as session:
        grants = _pass(session, settings)
    for granted in grants:
        try:
            send_node_messages(settings, granted)
        except Exception as err:  # noqa: BLE001 - the reconciler re-sends messages of nodes still assigned
            log.warning("sending the node messages of %s failed (will be re-sent): %s", granted.job_id, err)
    return grants


def check_fits(session: Session, settings: Settings, team: str, res: Resources) -> None:
    """Refuse (422) a request no registered host set could ever satisfy. With no host registered at all the cluster
    is still starting, so the job is accepted and waits with a pending reason."""
    limit = settings.device_limit(team)
    if limit and res.world_size > limit:
        raise ApiError(
            422,
            "unschedulable",
            f"resources: the job needs {res.world_size} devices but team {team} may hold at most {limit}",
            "resources",
        )
    hosts = list(session.scalars(select(Host)))
    if not hosts:
        return
    kind = res.device_type
    sizes = sorted((len(host_ids(h)) for h in hosts if h.device_type == kind), reverse=True)
    if not sizes:
        kinds = sorted({h.device_type for h in hosts})
        raise ApiError(
            422,
            "unschedulable",
            f"resources.device_type: no {kind} host is registered (hosts have: {', '.join(kinds)})",
            "resources.device_type",
        )
    if sizes[0] < res.nproc_per_node:
        raise ApiError(
            422,
            "unschedulable",
            f"resources.nproc_per_node: {res.nproc_per_node} {kind} devices per node "
            f"requested, but the largest {kind} host has {sizes[0]}",
            "resources.nproc_per_node",
        )
    enough = sum(s >= res.nproc_per_node for s in sizes)
    if enough < res.nnodes:
        raise ApiError(
            422,
            "unschedulable",
            f"resources.nnodes: {res.nnodes} nodes of {res.nproc_per_node} {kind} "
            f"devices requested, but only {enough} {kind} hosts have that many",
            "resources.nnodes",
        )


def check_memory_fits(session: Session, spec: JobBase) -> None:
    """422 ``does_not_fit`` (naming the field to change, with the per-rank breakdown) when the planner's peak for a
    rank exceeds the device memory every host of the job's device type registered; hosts that registered none are
    not checked (``engine.plan.check_registered_memory``)."""
    kind = spec.resources.device_type
    try:
        check_registered_memory(spec, session.scalars(select(Host.info).where(Host.device_type == kind)))
    except DoesNotFit as err:
        raise ApiError(422, "does_not_fit", str(err), err.field) from err
