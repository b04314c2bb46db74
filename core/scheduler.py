"""Device scheduler: grants whole gangs of devices atomically, priorities first, teams in turn within a priority
(the team holding the fewest devices next, ``fair_order``), FIFO within a team.

One pass (``_pass``) is one transaction that first updates ``scheduler_lock`` row 1: on PostgreSQL that
row lock serialises concurrent schedulers (as SELECT ... FOR UPDATE would), on SQLite the first write takes the
database write lock (as BEGIN IMMEDIATE would). Any process may run a pass (the API on submit and in its reconciler,
every worker on start, after a job and on its heartbeat); the lock makes them safe, and ``uq_leases_host_device``
makes a double grant impossible even if it were not.

A pass reads the live hosts' free devices once into an in-memory index (``FreeIndex``) and places gangs from it;
its grants are written together at the end (``grant_all``: one UPDATE per 500 jobs, then every lease, node and event
row as batches): one lease row per device and one ``job_nodes`` row per node, each job queued/retrying -> starting
(attempt + 1). After the commit it sends each node's "run node" message to its host's queue. A heartbeat's pass is
skipped while any pass ran recently (``schedule(backstop=True)``, ``scheduler_lock.passed_at``). Passes coalesce on
PostgreSQL: a caller that finds one running asks for another instead of waiting (``schedule``). A job that
does not fit waits with a ``pending_reason``; it also holds back the later jobs of its device type (no backfill), so
a big gang job is never starved by small ones. A retried job that fits waits out its backoff (``retry_not_before``,
set by ``core.recovery.end_attempt``) without holding others back. A job that can never fit is refused at submission
(``check_fits``).
"""

from __future__ import annotations

import logging
import zlib
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache, partial
from heapq import heapify, heappop, heappush
from itertools import groupby
from typing import Any

from sqlalchemy import CompoundSelect, Select, bindparam, case, func, insert, select, tuple_, union_all, update
from sqlalchemy.orm import Session, aliased

from core.db import session_scope
from core.disk_watch import held_jobs
from core.errors import ApiError
from core.messaging import send_run_node
from core.models import WAITING_ROWS, Event, Host, Job, JobNode, Lease, SchedulerLock, utcnow
from core.settings import Settings
from core.slurm.pools import check_pool_fits
from core.states import NODE_ACTIVE, WAITING, HostState, JobState, NodeState, sources
from engine.contract.plan import DoesNotFit, check_registered_memory
from engine.contract.plan.planner import DEVICE_MEMORY_KEY, HOST_MEMORY_KEY
from engine.contract.spec import JobBase, Resources
from engine.contract.trace_admission import admit_by_trace

log = logging.getLogger(__name__)


@dataclass
class HostView:
    name: str
    address: str
    free_count: int
    total: int
    free: list[int] | None = None  # the free device ids: read only for hosts a placement looks at (``FreeIndex``)


@dataclass(slots=True)
class Waiting:
    """The columns of a waiting job a pass reads (whole rows, their specs parsed, cost more than the pass itself)."""

    id: str
    team: str
    state: str
    priority: int
    attempt_count: int
    request_id: str | None
    pending_reason: str | None
    created_at: datetime
    resources: str | None  # the spec's resources as JSON text: parsed once per distinct text (``resources_of``)
    retry_not_before: datetime | None = None  # a retrying job's backoff (``core.recovery.retry_backoff``)


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
        .values(generation=SchedulerLock.generation + 1, passed_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def host_ids(host: Host) -> list[int]:
    return list(host.device_ids) if host.device_ids is not None else list(range(host.devices))


def is_live(host: Host, settings: Settings) -> bool:
    return host.state == HostState.up.value and host.heartbeat_at > utcnow() - timedelta(
        seconds=settings.host_stale_after_s
    )


def live_hosts(session: Session, settings: Settings) -> dict[str, list[HostView]]:
    """Every live host's count of free devices, per device type, in two reads per pass whatever the number of
    waiting jobs: the live hosts and the count of leased devices per host (aggregated in the database). Which
    devices are free is read later, only for the hosts a placement considers (``free_ids``): reading every lease and
    device list of 1,000 fragmented hosts on every pass was most of a pass's CPU time. The counts are joined here,
    not in SQL: on tables whose statistics lag their churn (a fresh database, a burst of registrations) PostgreSQL
    joined 1,000 hosts to the lease aggregate by a nested loop, 45 ms a pass."""
    db = session.connection()  # plain rows, without the ORM's per-row work: these reads scale with the cluster
    cutoff = utcnow() - timedelta(seconds=settings.host_stale_after_s)
    live = (Host.state == HostState.up.value) & (Host.heartbeat_at > cutoff)  # is_live, in SQL
    held = dict(db.execute(select(Lease.host, func.count()).group_by(Lease.host)).all())
    columns = (Host.name, Host.device_type, Host.address, Host.devices)
    views: dict[str, list[HostView]] = {}
    for name, kind, address, devices in db.execute(select(*columns).where(live).order_by(Host.name)).all():
        # a host registers ``devices == len(device_ids)``
        views.setdefault(kind, []).append(HostView(name, address or "127.0.0.1", devices - held.get(name, 0), devices))
    return views


def free_ids(session: Session, hosts: list[HostView]) -> None:
    """Fill ``free`` (the free device ids) of ``hosts``: their device ids and leases, in two reads per 500 hosts."""
    db, by_name = session.connection(), {h.name: h for h in hosts}
    for chunk in _chunks(sorted(by_name)):
        taken: dict[str, set[int]] = {}
        for name, device in db.execute(select(Lease.host, Lease.device).where(Lease.host.in_(chunk))).all():
            taken.setdefault(name, set()).add(device)
        for name, device_ids in db.execute(select(Host.name, Host.device_ids).where(Host.name.in_(chunk))).all():
            view = by_name[name]
            ids = range(view.total) if device_ids is None else device_ids
            view.free = [d for d in ids if d not in taken.get(name, ())]
            view.free_count = len(view.free)  # the leases as read now (a lease released since the count)


class FreeIndex:
    """The live hosts of one device type by their number of free devices (name order within a number), updated as
    the pass grants: a placement looks at the few counts that fit instead of sorting every host, so a pass granting
    G gangs over H hosts costs about G·log H, not G·H. The free device ids of a host are read when a placement first
    looks at it (``load``: ``free_ids``), with those of up to ``PREFETCH`` other hosts of the buckets it looks at,
    so a pass that fills many hosts reads them in a few batches."""

    PREFETCH = 64

    def __init__(self, hosts: list[HostView], load: Callable[[list[HostView]], None] | None = None):
        self.hosts = hosts  # name order; each view's ``free_count`` (and ``free`` once read) is kept current
        self.load = load
        self.by_free: dict[int, list[HostView]] = {}
        for host in hosts:
            if host.free_count > 0:
                self.by_free.setdefault(host.free_count, []).append(host)

    def place(self, res: Resources) -> list[tuple[HostView, list[int]]] | None:
        """``nnodes`` distinct hosts with ``nproc_per_node`` free devices each, fullest first (best fit), or None."""
        while True:
            counts = sorted(c for c in self.by_free if c >= res.nproc_per_node)
            if sum(len(self.by_free[c]) for c in counts) < res.nnodes:
                return None
            chosen = [host for c in counts for host in self.by_free[c][: res.nnodes]][: res.nnodes]
            unread = [host for host in chosen if host.free is None]
            if not unread:
                return [(host, (host.free or [])[: res.nproc_per_node]) for host in chosen]
            self._read(unread, counts)  # the counts may have moved (a lease taken or released since): look again

    def _read(self, unread: list[HostView], counts: list[int]) -> None:
        names = {h.name for h in unread}
        more = (h for c in counts for h in self.by_free[c] if h.free is None and h.name not in names)
        batch = unread + [h for h, _ in zip(more, range(self.PREFETCH), strict=False)]
        before = {h.name: h.free_count for h in batch}
        if self.load is None:
            raise RuntimeError("FreeIndex: hosts without device ids and no loader")
        self.load(batch)
        for host in batch:
            host.free = host.free if host.free is not None else []
            if host.free_count != before[host.name]:
                self._move(host, before[host.name])

    def _move(self, host: HostView, old: int) -> None:
        """Re-file ``host`` from bucket ``old`` to its ``free_count`` now."""
        bucket = self.by_free.get(old, [])
        at = bisect_left(bucket, host.name, key=_name)
        if at < len(bucket) and bucket[at] is host:
            del bucket[at]
        if old in self.by_free and not bucket:
            del self.by_free[old]
        if host.free_count > 0:
            insort(self.by_free.setdefault(host.free_count, []), host, key=_name)

    def take(self, placement: list[tuple[HostView, list[int]]]) -> None:
        for host, devices in placement:
            old = host.free_count
            host.free = [d for d in host.free or [] if d not in devices]
            host.free_count = len(host.free)
            self._move(host, old)


def _name(host: HostView) -> str:
    return host.name


def team_usage(session: Session) -> dict[str, int]:
    return {team: count for team, count in session.execute(select(Lease.team, func.count()).group_by(Lease.team))}


def _free_summary(hosts: list[HostView], limit: int = 5) -> str:
    parts = [f"host {h.name} has {h.free_count} free" for h in hosts[:limit]]
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
    enough = sum(h.free_count >= res.nproc_per_node for h in hosts)
    return (
        f"waiting for {res.nnodes} hosts with {res.nproc_per_node} free {kind} devices each ({enough} have enough); "
        f"{_free_summary(hosts)}"
    )


def used_ports(session: Session, masters: set[str]) -> dict[str, set[int]]:
    """The rendezvous ports node 0 of an active job holds on each of ``masters``: one read for the whole pass."""
    used: dict[str, set[int]] = {master: set() for master in masters}
    active = [s.value for s in NODE_ACTIVE]
    for chunk in _chunks(sorted(masters)):
        rows = select(JobNode.host, JobNode.master_port).where(
            JobNode.host.in_(chunk), JobNode.node_rank == 0, JobNode.state.in_(active)
        )
        for host, port in session.execute(rows):
            used[host].add(port)
    return used


def choose_port(settings: Settings, used: set[int], master: str, job_id: str, attempt: int) -> int:
    """A rendezvous port on node 0's host that no active job there uses (``used``, which gets it); spread by job so
    retries rarely reuse one."""
    start = zlib.crc32(f"{job_id}:{attempt}".encode()) % settings.rdzv_port_count
    for i in range(settings.rdzv_port_count):
        port = settings.rdzv_port_base + (start + i) % settings.rdzv_port_count
        if port not in used:
            used.add(port)
            return port
    raise RuntimeError(f"all {settings.rdzv_port_count} rendezvous ports on {master} are in use")


def _chunks(items: list[Any], size: int = 500) -> Iterator[list[Any]]:
    """Bounded statements: an IN list or CASE of thousands of ids stays under SQLite's bound-parameter limit."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def start_jobs(session: Session, planned: list[Planned]) -> dict[str, int]:
    """Move the planned jobs queued/retrying -> starting (attempt + 1, master host set): one UPDATE per 500 jobs.
    Returns each started job's new attempt; a job cancelled since the pass read it is not among them."""
    now, started = utcnow(), dict[str, int]()
    for chunk in _chunks(planned):
        masters = case({p.job.id: p.placement[0][0].name for p in chunk}, value=Job.id)
        rows = session.execute(
            update(Job)
            .where(Job.id.in_([p.job.id for p in chunk]), Job.state.in_(sources(JobState.starting)))
            .values(
                state=JobState.starting.value,
                attempt_count=Job.attempt_count + 1,
                host=masters,
                pending_reason=None,
                updated_at=now,
                heartbeat_at=now,
                dispatched_at=now,
            )
            .returning(Job.id, Job.attempt_count)
            .execution_options(synchronize_session=False)
        )
        started.update((job_id, attempt) for job_id, attempt in rows)
    return started


def grant_all(session: Session, settings: Settings, planned: list[Planned]) -> list[Grant]:
    """Lease the planned gangs' devices and start their jobs, inside the caller's locked transaction, in a few
    statements for the whole pass (jobs, then all leases, nodes and events as batches) rather than several per job.
    A job cancelled meanwhile gets nothing; its devices stay free for the next pass."""
    if not planned:
        return []
    started = start_jobs(session, planned)
    planned = [p for p in planned if p.job.id in started]
    used = used_ports(session, {p.placement[0][0].name for p in planned})
    now = utcnow()
    leases: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    grants = []
    for p in planned:
        job, attempt, master = p.job, started[p.job.id], p.placement[0][0]
        port = choose_port(settings, used[master.name], master.name, job.id, attempt)
        for rank, (host, devices) in enumerate(p.placement):
            leases += [
                {
                    "host": host.name,
                    "device": d,
                    "job_id": job.id,
                    "team": job.team,
                    "attempt": attempt,
                    "node_rank": rank,
                    "created_at": now,
                }
                for d in devices
            ]
            nodes.append(
                {
                    "job_id": job.id,
                    "attempt": attempt,
                    "node_rank": rank,
                    "host": host.name,
                    "devices": devices,
                    "master_addr": master.address,
                    "master_port": port,
                    "state": NodeState.assigned.value,
                    "heartbeat_at": now,
                    "created_at": now,
                }
            )
        where = ", ".join(f"{h.name} {p.kind} {d}" for h, d in p.placement)
        events.append(
            {
                "job_id": job.id,
                "type": "state",
                "message": f"starting attempt {attempt} on {where}",
                "level": "info",
                "attempt": attempt,
                "time": now,
                "data": {"state": "starting", "nodes": [{"host": h.name, "devices": d} for h, d in p.placement]},
            }
        )
        grants.append(Grant(job.id, attempt, [h.name for h, _ in p.placement], job.request_id))
    for model, rows in ((Lease, leases), (JobNode, nodes), (Event, events)):
        if rows:
            session.execute(insert(model), rows)
    return grants


def retry_reason(not_before: datetime, attempt: int) -> str:
    return f"retrying after {not_before:%Y-%m-%d %H:%M:%S} UTC (attempt {attempt})"


@lru_cache(maxsize=256)
def _behind_text(shown: str, plural: bool, kind: str) -> str:
    return f"waiting behind {shown} job{'s' if plural else ''} (higher priority or queued earlier) for {kind} devices"


BEHIND_EXACT_BELOW = 5  # a job this close to the front sees its exact place; further back, a 1-2-5 step


@lru_cache(maxsize=16384)
def behind_reason(count: int, kind: str) -> str:
    """Why a job waits behind others: how many, not whose (their ids may be other teams'). From 5 the count is
    rounded down to 1-2-5 steps ("5+", "10+", "1000+"): an exact count changes for every job behind whenever one
    ahead starts, and each change rewrites a job row (exact up to 20, half the jobs table's updates at 100
    simulated hosts: issue 47); in steps only the few jobs at the front and those crossing a step are rewritten."""
    return _behind_text(str(count) if count < BEHIND_EXACT_BELOW else f"{_step_below(count)}+", count != 1, kind)


def fair_order(jobs: list[Waiting], usage: dict[str, int]) -> Iterator[Waiting]:
    """``jobs`` (sorted by priority, then age) in the order to consider them: higher priority first; within a
    priority, the oldest job of the team holding the fewest devices now. ``usage`` is read as the pass grants (only
    the team just yielded can have changed, so a heap of teams keeps each step at log(teams)), so teams take turns
    and one team's backlog never pushes another team's jobs back behind all of it."""
    for _priority, level in groupby(jobs, key=lambda job: job.priority):
        queues: dict[str, deque[Waiting]] = {}
        for job in level:
            queues.setdefault(job.team, deque()).append(job)
        turns = [(usage.get(team, 0), queue[0].created_at, queue[0].id, team) for team, queue in queues.items()]
        heapify(turns)
        while turns:
            team = heappop(turns)[3]
            queue = queues[team]
            yield queue.popleft()
            if queue:  # the consumer has updated usage[team] by the time it asks for the next job
                heappush(turns, (usage.get(team, 0), queue[0].created_at, queue[0].id, team))


def behind_counts(waiting: list[Waiting], behind: dict[str, str]) -> dict[str, int]:
    """How many jobs each job held back by a blocked device type waits behind: the blocked job, plus those held back
    with it that come earlier in priority-then-submission order. Counted in that order, not in the pass's turn order:
    after a block the turns follow each team's current holdings, so counts by turn would reshuffle (and rewrite)
    thousands of reasons whenever one job ends; by age they only shrink as jobs ahead start."""
    earlier: dict[str, int] = {}
    counts = {}
    for job in waiting:
        if (kind := behind.get(job.id)) is not None:
            counts[job.id] = earlier.get(kind, 0) + 1
            earlier[kind] = counts[job.id]
    return counts


def _step_below(count: int) -> int:
    step = 1
    while step * 10 <= count:
        step *= 10
    return max(s for s in (step, 2 * step, 5 * step) if s <= count)


@lru_cache(maxsize=1024)
def resources_of(raw: str | None) -> Resources:
    """A waiting job's resources from their JSON text, validated once per distinct text (a pass sees the same few
    shapes many times; reading them as text spares decoding a JSON value per waiting job per pass)."""
    return Resources.model_validate_json(raw or "{}")


WAITING_COLUMNS = (Job.id, Job.team, Job.state, Job.priority, Job.attempt_count, Job.request_id, Job.pending_reason)


@lru_cache(maxsize=1)
def _shapes_query() -> Select[tuple[str, str]]:
    """Each (team, resources) with a job waiting, read by skipping through ``ix_jobs_waiting_turn`` (each step one
    index probe for the next key above the last): a few reads per shape, not one per waiting job. Built once: on
    every pass, building it cost more than running it."""
    first, k, step = aliased(Job), aliased(Job), aliased(Job)
    known = first.resources.is_not(None)  # a row without them waits for ``fill_resources``
    start = select(first.team, first.resources).where(WAITING_ROWS, known).order_by(first.team, first.resources)
    shapes = select(start.limit(1).subquery()).cte("shapes", recursive=True)
    above = (
        select(k.id)
        .where(WAITING_ROWS, k.resources.is_not(None))
        .where(tuple_(k.team, k.resources) > tuple_(shapes.c.team, shapes.c.resources))
        .order_by(k.team, k.resources)
        .limit(1)
        .scalar_subquery()
    )
    shapes = shapes.union_all(select(step.team, step.resources).join_from(shapes, step, step.id == above))
    return select(shapes.c.team, shapes.c.resources)


@lru_cache(maxsize=256)
def _firsts_query(shapes: int, window: int) -> CompoundSelect:
    """The first ``window`` waiting jobs of each of ``shapes`` (team, resources) pairs, bound as ``team_i`` and
    ``resources_i``: one index range per pair. Each arm is a subquery: SQLite allows no ORDER BY or LIMIT on a bare
    arm of a UNION."""
    order = (Job.priority.desc(), Job.created_at, Job.id)
    arms = [
        select(*WAITING_COLUMNS, Job.created_at, Job.resources, Job.retry_not_before)
        .where(WAITING_ROWS, Job.team == bindparam(f"team_{i}"), Job.resources == bindparam(f"resources_{i}"))
        .order_by(*order)
        .limit(window)
        .subquery()
        for i in range(shapes)
    ]
    return union_all(*(select(arm) for arm in arms))


def waiting_jobs(session: Session, window: int) -> list[Waiting]:
    """The jobs a pass considers, in grant order (priority, then submission): the first ``window`` of each team and
    gang shape. What a pass can do with the jobs behind those is already decided by them: a later job of the same
    shape cannot start while an earlier one waits (no backfill), and one that could start once those ahead did is
    considered by the next pass. Read per shape from ``ix_jobs_waiting_turn`` (``window`` index entries each, many
    shapes to a statement), so a pass costs the teams and shapes waiting, not a backlog of 10,000 jobs."""
    db, rows = session.connection(), list[Any]()  # plain rows: on every pass
    for chunk in _chunks(list(db.execute(_shapes_query()).tuples()), 100):
        params = {f"team_{i}": team for i, (team, _) in enumerate(chunk)}
        params.update((f"resources_{i}", raw) for i, (_, raw) in enumerate(chunk))
        rows += db.execute(_firsts_query(len(chunk), window), params).all()
    rows.sort(key=lambda row: (-row.priority, row.created_at, row.id))
    return [Waiting(*row) for row in rows]


def fill_resources(session: Session) -> int:
    """Give waiting rows inserted without ``resources`` (by a replica older than migration 0007) their spec's, so
    ``waiting_jobs`` sees them; the reconciler runs this before its pass. Returns how many were filled."""
    missing = select(Job.id).where(Job.state.in_([s.value for s in WAITING]), Job.resources.is_(None))
    filled = session.execute(
        update(Job)
        .where(Job.id.in_(missing.scalar_subquery()))
        .values(resources=Job.spec["resources"].as_string())
        .execution_options(synchronize_session=False)
    )
    return filled.rowcount or 0  # type: ignore[attr-defined]


def write_reasons(session: Session, reasons: list[dict[str, str]]) -> None:
    """One statement for every changed pending reason of the pass (a job that moved on meanwhile keeps its own).

    A reason is advice: rows another transaction holds are skipped (``SKIP LOCKED``; SQLite locks the whole
    database instead), their reasons written by a later pass. Waiting for them could deadlock: the reconciler marks
    a queue's waiting jobs dispatched in one statement, locking rows in its scan order while the pass holds others."""
    if not reasons:
        return
    db, free = session.connection(), set[str]()
    for chunk in _chunks(sorted({r["job_id"] for r in reasons})):
        free.update(db.scalars(select(Job.id).where(Job.id.in_(chunk)).with_for_update(skip_locked=True)))
    reasons = [r for r in reasons if r["job_id"] in free]
    if reasons:
        db.execute(
            update(Job)
            .where(Job.id == bindparam("job_id"), Job.state == bindparam("job_state"))
            .values(pending_reason=bindparam("reason")),
            reasons,
        )


@dataclass(slots=True)
class Planned:
    job: Waiting
    kind: str
    placement: list[tuple[HostView, list[int]]]


def recently_passed(session: Session, settings: Settings) -> bool:
    """A pass ran anywhere within ``schedule_backstop_s``: a heartbeat's backstop pass would find what it found."""
    last = session.scalar(select(SchedulerLock.passed_at).where(SchedulerLock.id == 1))
    return last is not None and last > utcnow() - timedelta(seconds=settings.schedule_backstop_s)


def _pass(session: Session, settings: Settings) -> list[Grant]:
    lock(session)
    reasons: list[dict[str, str]] = []
    usage = team_usage(session)
    waiting = waiting_jobs(session, settings.schedule_window)
    jobs = fair_order(waiting, usage)
    load = partial(free_ids, session)
    hosts = {kind: FreeIndex(views, load) for kind, views in live_hosts(session, settings).items()}
    blocked: dict[str, str] = {}
    behind: dict[str, str] = {}  # job id -> its device type, which a job earlier in turn could not get
    planned: list[Planned] = []
    started: dict[tuple[str, str | None], int] = {}  # per team and shape: all its window started, more may fit
    now = utcnow()
    disk_held = held_jobs(session, settings, [j.id for j in waiting])  # {} unless a data root is nearly full
    for job in jobs:
        res = resources_of(job.resources)
        if res.pool is not None:
            continue  # a Slurm pool's job: Slurm schedules it (core.slurm, run by worker.slurm_agent)
        kind = res.device_type
        index = hosts.get(kind) or hosts.setdefault(kind, FreeIndex([]))
        limit, held = settings.device_limit(job.team), usage.get(job.team, 0)
        if limit and held + res.world_size > limit:
            reason = f"team {job.team} holds {held} of its {limit} devices; this job needs {res.world_size}"
        elif job.id in disk_held:  # its outputs' data root is below disk_wait_below_bytes: holding back no other job
            reason = disk_held[job.id]
        elif kind in blocked:
            behind[job.id] = kind
            continue
        elif (placement := index.place(res)) is None:
            reason, blocked[kind] = waiting_reason(res, index.hosts, settings), job.id
        elif job.retry_not_before is not None and job.retry_not_before > now:  # fits, but waits out its backoff
            reason = retry_reason(job.retry_not_before, job.attempt_count + 1)  # holding back no other job
        else:
            index.take(placement)
            usage[job.team] = held + res.world_size
            planned.append(Planned(job, kind, placement))
            started[(job.team, job.resources)] = started.get((job.team, job.resources), 0) + 1
            continue
        if reason != job.pending_reason:
            reasons.append({"job_id": job.id, "job_state": job.state, "reason": reason})
    counts = behind_counts(waiting, behind)
    for job in waiting:
        if job.id in counts and (reason := behind_reason(counts[job.id], behind[job.id])) != job.pending_reason:
            reasons.append({"job_id": job.id, "job_state": job.state, "reason": reason})
    write_reasons(session, reasons)
    session.info[WINDOW_USED_UP] = any(n >= settings.schedule_window for n in started.values())
    return grant_all(session, settings, planned)


def send_node_messages(settings: Settings, grant_: Grant) -> None:
    for rank, host in enumerate(grant_.hosts):
        send_run_node(settings, grant_.job_id, grant_.attempt, rank, host, grant_.request_id)


WINDOW_USED_UP = "llmjobs.window_used_up"  # a pass's ``session.info`` key: it started a whole window of one shape
LOCK_ROW, ASKED_ROW = 1, 2  # scheduler_lock rows: the lock every pass holds; the count of passes asked for meanwhile
MAX_PASSES = 16  # per ``schedule`` call; a pass by any process later goes on (each event runs one)


def lock_is_free(session: Session) -> bool:
    """Take the scheduler lock's row if no pass holds it; False (without waiting) if one does. PostgreSQL only
    (``SKIP LOCKED``); SQLite has no row locks, a pass there waits for the database's write lock."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    held = select(SchedulerLock.id).where(SchedulerLock.id == LOCK_ROW).with_for_update(skip_locked=True)
    return session.scalar(held) is not None


def asked(session: Session) -> int | None:
    return session.scalar(select(SchedulerLock.generation).where(SchedulerLock.id == ASKED_ROW))


def ask_for_pass(settings: Settings) -> bool:
    """Count one more pass asked for, in its own short transaction (another row than the lock's, so it never waits
    for a pass); the pass running now runs once more when it sees the count changed. False: no such row."""
    with session_scope(settings.database_url) as session:
        moved = session.execute(
            update(SchedulerLock)
            .where(SchedulerLock.id == ASKED_ROW)
            .values(generation=SchedulerLock.generation + 1)
            .execution_options(synchronize_session=False)
        )
        return moved.rowcount == 1  # type: ignore[attr-defined]


def schedule(settings: Settings, backstop: bool = False) -> list[Grant]:
    """Scheduling passes; sends the granted nodes' messages after each commit. Returns this call's grants.

    Passes coalesce (PostgreSQL): a caller that finds a pass running does not queue behind it for one more pass that
    finds nothing new (at 1,000 hosts, node exits arrive faster than passes end: workers waited seconds for the lock).
    It counts an ask (``ask_for_pass``) and tries the lock once more (the running pass may have ended before the
    ask); the pass running meanwhile read the count when it began and runs again when it changed, so each ask is
    followed by a pass that began after it and sees what the asker committed. A pass that started every job of
    one team and shape it read (``schedule_window`` of them) is followed by another at once: a pass reads a bounded
    window, so its cost stays that of the teams and shapes waiting while a free cluster still fills in a few passes.
    A caller runs at most ``MAX_PASSES`` passes; a pass by any process later serves the rest.

    ``backstop`` (a host heartbeat's pass: 200 a second at 1,000 hosts beating every 5 s): no pass, and no wait for
    the scheduler lock, when any process ran a pass within ``schedule_backstop_s`` (one primary-key read) or one is
    running. Events that can start a job run their own full pass (a submission, a node's end, a worker's start, the
    reconciler), so heartbeats only catch what no event announced (a host back from stale, a pass lost to a crash),
    within that interval."""
    if backstop:
        with session_scope(settings.database_url) as session:
            if recently_passed(session, settings):
                return []
    grants: list[Grant] = []
    has_asked = False
    for _ in range(MAX_PASSES):
        with session_scope(settings.database_url) as session:
            ran = lock_is_free(session)
            if ran:
                seen = asked(session)
                granted = _pass(session, settings)
                again = session.info.pop(WINDOW_USED_UP, False)
        if not ran:
            if backstop or has_asked:
                return grants  # a heartbeat announces nothing; an asker is served by the running pass's next
            has_asked = True
            if not ask_for_pass(settings):
                with session_scope(settings.database_url) as session:  # no ask row (a database before 0010): wait
                    granted = _pass(session, settings)
                _send(settings, granted)
                return grants + granted
            continue
        _send(settings, granted)
        grants += granted
        if again:
            continue  # the jobs behind a window that all started may fit too
        with session_scope(settings.database_url) as session:
            if asked(session) == seen:
                return grants
    return grants


def _send(settings: Settings, grants: list[Grant]) -> None:
    for granted in grants:
        try:
            send_node_messages(settings, granted)
        except Exception as err:  # noqa: BLE001 - the reconciler re-sends messages of nodes still assigned
            log.warning("sending the node messages of %s failed (will be re-sent): %s", granted.job_id, err)


def check_fits(session: Session, settings: Settings, team: str, res: Resources) -> None:
    """Refuse (422) a request no registered host set could ever satisfy. With no host registered at all the cluster
    is still starting, so the job is accepted and waits with a pending reason."""
    if res.pool is not None:  # a Slurm pool's job is checked against its pool
        check_pool_fits(settings, res)
        return
    limit = settings.device_limit(team)
    if limit and res.world_size > limit:
        raise ApiError(
            422,
            "unschedulable",
            f"resources: the job needs {res.world_size} devices but team {team} may hold at most {limit}",
            "resources",
        )
    hosts = session.execute(select(Host.device_type, Host.devices, Host.device_ids)).all()  # columns: per submission
    if not hosts:
        return
    kind = res.device_type
    sizes = sorted((n if ids is None else len(ids) for t, n, ids in hosts if t == kind), reverse=True)
    if not sizes:
        kinds = sorted({t for t, _, _ in hosts})
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


def check_memory_fits(session: Session, spec: JobBase, settings: Settings | None = None) -> None:
    """422 ``does_not_fit`` (naming the field to change, with the per-rank breakdown) when the planner's peak for a
    rank exceeds the device memory every host of the job's device type registered; hosts that registered none are
    not checked (``engine.contract.plan.check_registered_memory``). The plan decides on the job's data when it can read it;
    a job that fits only on its data gets ``max_micro_batch_tokens`` so the engine refuses a larger micro-batch.
    With ``settings.admission_trace_s`` a job using a feature the planner has no model of is traced instead
    (``engine.contract.trace_admission``), the planner deciding when the trace runs over that budget or fails."""
    if spec.resources.pool is not None:
        return  # checked against its pool's device memory (core.slurm.pools.check_pool_memory, by admission)
    kind = spec.resources.device_type
    largest, ram = session.execute(
        select(
            func.max(Host.info[DEVICE_MEMORY_KEY].as_float()), func.max(Host.info[HOST_MEMORY_KEY].as_float())
        ).where(Host.device_type == kind)
    ).one()
    info = {DEVICE_MEMORY_KEY: int(largest), **({HOST_MEMORY_KEY: int(ram)} if ram else {})} if largest else None
    if largest and settings is not None and settings.admission_trace_s:
        traced = admit_by_trace(spec, int(largest), settings.admission_trace_s)
        if traced is not None and not traced.fits:
            raise ApiError(422, "does_not_fit", traced.message(), "resources")
        if traced is not None:
            return
    try:  # the largest device memory and host RAM are all the check uses: two numbers, not every host's info
        plan = check_registered_memory(spec, [info] if info else [])
    except DoesNotFit as err:
        raise ApiError(422, "does_not_fit", str(err), err.field) from err
    if plan is not None and plan.data is not None and plan.peak.total_bytes > (plan.device_memory_bytes or 0):
        # admitted on its data's largest micro-batch only: the engine holds the data to it (engine.contract.plan.data_shape)
        limit = getattr(spec, "max_micro_batch_tokens", None)
        spec.max_micro_batch_tokens = min(limit or plan.data.tokens, plan.data.tokens)  # type: ignore[attr-defined]
