"""Control-plane scale: scheduling passes, API latency, reconciler passes and database growth at 10 -> 1,000 hosts.

Per scale (``--hosts 10,100,1000``), on a database of its own created on the PostgreSQL server ``--postgres`` names
(``llmjobs_bench_cp_<random>``, ``bench.common.postgres.own_database``: dropped afterwards with its connections,
never the tests' shared ``test`` database) and Redis
as the broker (``--redis``, default db 5; this run's queues are deleted afterwards):

- ``hosts`` simulated 8-device ``cuda`` hosts register (``worker.hosts.register_host``) and heart-beat, one beat per
  host every ``heartbeat_interval_s``: from two child processes, the hosts due in each 0.25 s stamped in one
  statement (``beat_many``); the rest of each beat (``finish_parked``, ``sweep_host``, then the backstop scheduling
  pass) where that host's nodes run (``run_nodes``). The simulator and the API's load clients run at the lowest CPU
  priority (nice 19: they stand for other machines), so the API, the scheduler and PostgreSQL get the CPU they need
  on a shared 2-core machine;
- ``10 × hosts`` train jobs of mixed gang sizes (1×1 .. 4×8 devices) are queued first (``core.jobs.create_job``, the
  API's own insert, as if submitted earlier and already dispatched), and untimed passes start the hosts' first jobs
  from them (``fill_cluster``: the load begins on a full cluster; each measuring process's first pass, which
  compiles its statements, is untimed too);
- a real ``llmjobs api`` (its dispatcher and reconciler loops running) takes ``--rate`` submissions/s for
  ``--seconds`` s (``POST /v1/jobs``) from ``--clients`` clients that also send as many ``GET /v1/jobs/{id}`` and
  ``GET /healthz`` (paced closed loop: where the API cannot keep up, the achieved rate is reported, not a queue),
  in a child process of their own (the API's users are not in a worker's process: see ``load_process``);
- each node granted to a simulated host runs the worker's steps with no engine: claimed, running, exited 0 at once
  with a ``result.json`` (``worker.node.claim_node``, ``mark_running``, ``finish_node``, ``after_node``: the job
  succeeds, its leases are released and a scheduling pass follows, as on a real worker), at normal priority, in
  ``--runners`` child processes (each for a share of the hosts, one node at a time: a pass shares its interpreter
  with no other node's steps, as in a worker on its own host). The node's "run node" message still goes to Redis;
  the simulator reads ``job_nodes`` instead of consuming it.

Figures per scale: ``schedule_p99_ms`` (one pass with the scheduler lock held, every pass this process ran: after
node exits and on heartbeats) and ``schedule_cpu_p99_ms`` (the same passes' own CPU time, ``time.thread_time``: the
control plane's cost whatever else shares the CPUs), ``schedule_wall_split_ms`` (where the wall time of the median
and of the slowest 1% of passes went: own CPU, runnable waiting for a CPU (``/proc/thread-self/schedstat``), off the
CPU (PostgreSQL's answers, row locks, the GIL) and inside statements), ``schedule_p99_ms_by_where`` (after a node's
exit, a beat's backstop, the reconciler), ``schedule_quiet_p99_ms`` (``--quiet-passes`` passes after the load, alone on the
machine: the pass's own cost), ``get_p99_ratio``/``post_p99_ratio`` (p99 vs ``/healthz`` p99 in the same run; the
README's load table targets 2 and 4), ``reconcile_s`` (one ``reconcile_once`` at the end of the load, the hosts
still heart-beating and the API up, with how many hosts it judged down; ``reconcile_cpu_s`` its own CPU time,
``reconcile_in_statements_s`` its time inside statements and ``reconcile_slowest_statements_ms`` the slowest),
``db_growth_mib_per_1000_finished`` (the database's growth during the load, every table's
``pg_total_relation_size`` with indexes and TOAST, dead rows included, less the submissions' own rows, per 1,000 jobs
finished: a submission's rows (job, spec, event and their index entries) are measured on the backlog's inserts
(``submission_kib``) and ``jobs_submitted`` times that is subtracted, since submissions outrun finished jobs 3-4 to 1
here and are not what a job's run costs; ``db_growth_with_submissions_mib_per_1000_finished`` keeps them;
``db_growth_in_use_mib_per_1000_finished`` counts only the bytes rows hold (dead ones included), leaving out the free
room inside the tables' pages at both ends (``pgstattuple``: pages PostgreSQL allocated ahead of the API's concurrent
inserts, fillfactor's room, but also room a row left when an update moved it to another page: a floor where the
allocated figure is a ceiling) and ``db_free_room_kib_per_1000_finished_by_table`` that room by table; by
table with and without each table's share of the submissions, and ``db_row_writes_per_finished_job``: each table's
inserts, updates, HOT updates (no new index entries) and deletes, ``pg_stat_user_tables``), ``heartbeat_lag_p99_s`` (a beat's commit past its due time), ``hosts_judged_down_during_load`` (the
API leader's host verdicts through the load, ``host_stale_after_s`` as deployed: 30 s) and ``nodes_lost``. ``growth`` gives each figure's factor from one scale to the next against the host factor
(``linear`` when it grows no faster than the hosts do, with 50% slack). Targets (``TARGETS``, issue 47) at the largest
scale: pass CPU p99 <= 50 ms, wall p99 <= 200 ms, heartbeat lag p99 <= 5 s, no host judged down, no node lost,
reconciler pass <= 1 s; database growth <= 10 MiB per 1,000 finished jobs at every scale; the API ratios; linear.

    python bench/control_plane.py                       # 10, 100, 1000 hosts, 50 submissions/s for 60 s each
    python bench/control_plane.py --hosts 1000 --seconds 30
    python bench/control_plane.py --smoke               # 10 hosts, 100 jobs, 3 s (CI)
    python bench/control_plane.py --hosts 1000 --gc default   # the measuring processes without core.gc_tuning
    python bench/control_plane.py --hosts 1000 --seconds 120 --starve 120   # the starvation run

``--starve S``: for the load's first ``S`` seconds twice as many spinning processes as CPUs run at normal priority
beside the API, the scheduler and PostgreSQL (a CPU hog: they are starved, not deprioritised); the figures must
still show no host judged down and no node lost. Then one host (``sim-0000``) stops beating and
``stopped_host_judged_down_after_s`` says how long the service took to judge it down (None: it never did).

Last line: {"bench": "control_plane", "scales": [...], "growth": {...}, "targets_met": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

from api_load import free_port, pct, start_api, timed  # noqa: E402

from bench.common.postgres import DEFAULT_SERVER, own_database  # noqa: E402
from cli.env import prepare  # noqa: E402
from core import scheduler  # noqa: E402
from core.auth import create_token  # noqa: E402
from core.db import get_engine, session_scope  # noqa: E402
from core.gc_tuning import settle_heap  # noqa: E402
from core.jobs import create_job  # noqa: E402
from core.models import Host, Job, JobNode  # noqa: E402
from core.paths import team_areas  # noqa: E402
from core.reconciler import reconcile_once  # noqa: E402
from core.settings import Settings  # noqa: E402
from core.states import HostState, JobState, NodeState  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402
from sched_support import TINY_SHAPE, tiny_data  # noqa: E402
from worker import leases  # noqa: E402
from worker.hosts import beat_many, register_host  # noqa: E402
from worker.leases import node_token, running_here, sweep_host  # noqa: E402
from worker.node import after_node, claim_node, finish_node, finish_parked, mark_running  # noqa: E402

TEAM = "t"
DEVICES = 8
GANGS = [(1, 1)] * 4 + [(1, 2)] * 3 + [(1, 4)] * 2 + [(1, 8)] * 2 + [(2, 8), (4, 8)]  # (nnodes, nproc_per_node)
leases.kill_node_processes = lambda token, wait_s=0.0: []  # no engines: a simulated node leaves no process behind


def train_spec(data: str, gang: tuple[int, int], name: str) -> dict[str, Any]:
    """A tiny train job on ``gang`` devices (the spec is checked at submission; it never runs)."""
    nnodes, nproc = gang
    return {
        "kind": "train",
        "name": name,
        "data_path": [data],
        "split": "100,0,0",
        "train_iters": 4,
        "lr": 3e-3,
        "seq_length": 64,
        "micro_batch_size": 1,
        "global_batch_size": 64,
        "seed": 7,
        **TINY_SHAPE,
        "resources": {"device_type": "cuda", "nnodes": nnodes, "nproc_per_node": nproc},
    }


def runqueue_ns() -> int:
    """This thread's time spent runnable but waiting for a CPU (``/proc/thread-self/schedstat``'s second field): the
    part of a pass's wall time the kernel gave to other processes. 0 where the kernel does not report it."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class PassClock:
    """Times every scheduling pass of this process: from the scheduler lock taken to the pass's end (and the wait),
    and splits each pass's wall time: its own CPU time (``time.thread_time``), its time runnable but waiting for a
    CPU (``runqueue_ns``), the rest off the CPU (waiting on PostgreSQL's answers, a row lock, or this interpreter's
    GIL), and beside them the time inside its statements (cursor execute, their client-side CPU included)."""

    SERIES = ("held_ms", "cpu_ms", "runq_ms", "db_ms", "where", "pass_grants", "wait_ms")

    def __init__(self) -> None:
        self.held_ms: list[float] = []
        self.cpu_ms: list[float] = []  # beside held_ms: the pass's own CPU time (time.thread_time), load or not
        self.runq_ms: list[float] = []  # beside held_ms: runnable, waiting for a CPU
        self.db_ms: list[float] = []  # beside held_ms: inside its statements' cursor.execute
        self.where: list[str] = []  # beside held_ms: which step ran it (``label``)
        self.pass_grants: list[int] = []  # per pass, beside held_ms: what the slowest passes did
        self.wait_ms: list[float] = []
        self.grants = 0
        self.label = "node"  # set by the caller before a pass: "node" (after a node's exit), "backstop", "quiet"
        self._local = threading.local()
        self._lock, self._pass = scheduler.lock, scheduler._pass

    def _before_statement(self, *args: Any) -> None:
        self._local.statement = time.perf_counter()

    def _after_statement(self, *args: Any) -> None:
        if getattr(self._local, "db", None) is not None and getattr(self._local, "statement", None) is not None:
            self._local.db += time.perf_counter() - self._local.statement

    def install(self) -> None:
        def lock(session: Any) -> None:
            began = time.perf_counter()
            self._lock(session)
            self._local.locked = time.perf_counter()
            self._local.cpu = time.thread_time()
            self._local.runq = runqueue_ns()
            self._local.db = 0.0
            self.wait_ms.append((self._local.locked - began) * 1000)

        def timed_pass(session: Any, settings: Settings) -> list[scheduler.Grant]:
            grants = self._pass(session, settings)
            self.held_ms.append((time.perf_counter() - self._local.locked) * 1000)
            self.cpu_ms.append((time.thread_time() - self._local.cpu) * 1000)
            self.runq_ms.append((runqueue_ns() - self._local.runq) / 1e6)
            self.db_ms.append(self._local.db * 1000)
            self._local.db = None
            self.where.append(self.label)
            self.pass_grants.append(len(grants))
            self.grants += len(grants)
            return grants

        scheduler.lock, scheduler._pass = lock, timed_pass  # type: ignore[assignment]
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", self._before_statement)
        sa.event.listen(sa.engine.Engine, "after_cursor_execute", self._after_statement)

    def merge(self, got: dict[str, Any]) -> None:
        """Add a child process's passes (``figures``) to this clock."""
        for name in self.SERIES:
            getattr(self, name).extend(got[name])
        self.grants += got["grants"]

    def figures(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in self.SERIES}, "grants": self.grants}

    def quiet(self, settings: Settings, passes: int) -> tuple[list[float], list[float]]:
        """``passes`` full passes with nothing else running (the load stopped): the pass's own cost at this scale
        (wall, CPU), next to the loaded figure, where 2 CPUs are shared with the API, PostgreSQL and every simulated
        host."""
        first, self.label = len(self.held_ms), "quiet"
        for _ in range(passes):
            scheduler.schedule(settings)
        return self.held_ms[first:], self.cpu_ms[first:]

    def uninstall(self) -> None:
        scheduler.lock, scheduler._pass = self._lock, self._pass  # type: ignore[assignment]
        for name, listener in (
            ("before_cursor_execute", self._before_statement),
            ("after_cursor_execute", self._after_statement),
        ):
            if sa.event.contains(sa.engine.Engine, name, listener):
                sa.event.remove(sa.engine.Engine, name, listener)


class StatementClock:
    """Each statement's wall time (cursor execute: sent, waited for, answered) while ``recording``, by its first
    words: where a reconciler pass's wall time went under the load (its own CPU time is a small part of it)."""

    def __init__(self) -> None:
        self.by_statement: Counter[str] = Counter()
        self._local = threading.local()

    def _before(self, *args: Any) -> None:
        self._local.began = time.perf_counter()

    def _after(self, _conn: Any, _cursor: Any, statement: str, *args: Any) -> None:
        if getattr(self._local, "began", None) is not None:
            self.by_statement[" ".join(statement.split())[:90]] += time.perf_counter() - self._local.began

    @contextlib.contextmanager
    def recording(self) -> Any:
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", self._before)
        sa.event.listen(sa.engine.Engine, "after_cursor_execute", self._after)
        try:
            yield self
        finally:
            sa.event.remove(sa.engine.Engine, "before_cursor_execute", self._before)
            sa.event.remove(sa.engine.Engine, "after_cursor_execute", self._after)

    def slowest(self, n: int = 6) -> list[list[Any]]:
        return [[round(s * 1000, 1), text] for text, s in self.by_statement.most_common(n)]


def guarded(errors: list[str], what: str, step: Callable[[], object]) -> None:
    try:
        step()
    except Exception as err:  # noqa: BLE001 - counted and reported, the run goes on
        errors.append(f"{what}: {type(err).__name__}: {str(err)[:200]}")


def lowest_priority() -> None:
    """This process (or thread, on Linux) at the lowest CPU priority: the simulated hosts and the API's clients
    stand for other machines; here they must not take the CPU from the API, the scheduler and PostgreSQL."""
    at_priority(19)


def at_priority(nice: int) -> None:
    """This thread's nice value (Linux: per thread). Going back up to 0 needs CAP_SYS_NICE; without it the thread
    stays where it was (the run then under-states what a worker's own steps get, never the control plane's cost)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except PermissionError:
        pass


def beat_hosts(settings: Settings, names: list[str], stop: Any, out: Any, silenced: Any = None) -> None:
    """A child process at the lowest priority: the heartbeat of ``names``, each every ``heartbeat_interval_s``, the
    hosts due in each ``BEAT_SLOT_S`` stamped in one statement (``worker.hosts.beat_many``: recorded without
    contention). The rest of a worker's beat (its housekeeping and backstop pass) runs where the nodes run
    (``run_nodes``). Sends each beat's lag (its commit time past its due time) and its errors to ``out`` when
    ``stop`` is set. Once ``silenced`` is set, ``SILENCED`` (if among ``names``) beats no more: a host that really
    stopped."""
    lowest_priority()
    errors, lags = list[str](), list[float]()
    interval = settings.heartbeat_interval_s
    began = time.monotonic()
    due = {name: began + interval * i / len(names) for i, name in enumerate(names)}
    while not stop.wait(BEAT_SLOT_S):
        now = time.monotonic()
        batch = [name for name in names if due[name] <= now]
        if silenced is not None and silenced.is_set():
            batch = [name for name in batch if name != SILENCED]
        if not batch:
            continue
        guarded(errors, "heartbeat", lambda b=batch: beat_many(settings, b))
        done = time.monotonic()
        for name in batch:
            lags.append(max(0.0, done - due[name]))
            due[name] += interval * max(1, int((done - due[name]) // interval) + 1)  # a missed beat is not made up
    out.put({"kind": "beats", "lags": lags, "errors": errors})


def run_nodes(settings: Settings, names: list[str], stop: Any, out: Any, settle: bool = True) -> None:
    """A child process standing for the workers of ``names``: each node granted to them runs the worker's steps
    with no engine (``run_node``), one at a time in this process's one thread, so a node's scheduling pass never
    waits for this interpreter's lock behind another node's steps, as on a real cluster, where each host's worker
    is a process of its own on its own host. (With every node of the fleet in one process's thread pool beside the
    simulator's housekeeping threads at the lowest priority, a pass mostly waited for the GIL: held by a thread the
    kernel had descheduled.) Between nodes, each host's beat housekeeping as its worker does it: parked exits and
    the lease sweep at the lowest priority (they stand for other machines), then the backstop pass at normal
    priority, timed like the others. Sends the passes' times, the nodes run and the errors to ``out``."""
    clock, errors, mine, seen, done = PassClock(), list[str](), set(names), set[int](), 0
    scheduler.schedule(settings)  # untimed: this process's first pass compiles its statements
    if settle:  # as a worker does once started (``core.gc_tuning``)
        settle_heap()
    clock.install()
    interval = settings.heartbeat_interval_s
    began = time.monotonic()
    due = {name: began + interval * i / len(names) for i, name in enumerate(names)}
    while not stop.wait(0.1):
        try:
            with session_scope(settings.database_url) as session:
                assigned = session.execute(
                    sa.select(JobNode.id, JobNode.job_id, JobNode.attempt, JobNode.node_rank, JobNode.host).where(
                        JobNode.state == NodeState.assigned.value
                    )
                ).all()
        except Exception as err:  # noqa: BLE001
            errors.append(f"watch: {type(err).__name__}: {str(err)[:200]}")
            continue
        for node_id, job_id, attempt, rank, host in assigned:
            if host in mine and node_id not in seen and not stop.is_set():
                seen.add(node_id)
                clock.label = "node"
                guarded(errors, "node", lambda a=(job_id, attempt, rank, host): run_node(settings, *a))
                done += 1
        now = time.monotonic()
        for name in [n for n in names if due[n] <= now]:
            if stop.is_set() or time.monotonic() - now > HOUSEKEEPING_SLICE_S:
                break  # back to the nodes: the hosts left wait for the next round (a missed round is not made up)
            due[name] += interval * max(1, int((now - due[name]) // interval) + 1)  # a missed round is not made up
            at_priority(19)
            guarded(errors, "finish_parked", lambda n=name: finish_parked(settings, n))
            guarded(errors, "sweep_host", lambda n=name: sweep_host(settings, n))
            at_priority(0)
            clock.label = "backstop"
            guarded(errors, "heartbeat pass", lambda: scheduler.schedule(settings, backstop=True))
    out.put({"kind": "nodes", **clock.figures(), "nodes_done": done, "errors": errors})


def run_node(settings: Settings, job_id: str, attempt: int, rank: int, host: str) -> None:
    """``worker.node.run_node`` with the engine replaced by an immediate exit 0."""
    with running_here(node_token(job_id, attempt, rank)):
        work = claim_node(settings, job_id, attempt, rank, host)
        if work is None:
            return
        mark_running(settings, work, os.getpid(), ["simulated"], host)
        if rank == 0:
            work.run_dir.mkdir(parents=True, exist_ok=True)
            (work.run_dir / "result.json").write_text(json.dumps({"kind": "train", "outputs": {}, "summary": {}}))
        finish_node(settings, work, 0, None, None, time.monotonic() + 60)
        after_node(settings, job_id)


BEAT_SLOT_S = 0.25
HOUSEKEEPING_SLICE_S = 0.05  # at most this long on housekeeping between two looks for granted nodes
SILENCED = "sim-0000"  # the host that stops beating after a starvation run (``--starve``)


class SimulatedHosts:
    """``names`` heart-beating as workers do (``beaters`` child processes at the lowest priority); their nodes run
    the worker's steps in ``runners`` child processes (``run_nodes``), each for a share of the hosts."""

    def __init__(
        self,
        settings: Settings,
        names: list[str],
        runners: int,
        clock: PassClock,
        beaters: int = 2,
        settle: bool = True,
    ):
        self.clock = clock
        self.nodes_done = 0
        self.errors: list[str] = []
        self.beat_lags: list[float] = []
        self.closed = False
        spawn = multiprocessing.get_context("spawn")  # no forked copy of this process's pooled connections
        self.stop, self.out, self.silenced = spawn.Event(), spawn.Queue(), spawn.Event()
        self.beaters = [
            spawn.Process(target=beat_hosts, args=(settings, names[i::beaters], self.stop, self.out, self.silenced))
            for i in range(beaters)
        ]
        self.runners = [
            spawn.Process(target=run_nodes, args=(settings, names[i::runners], self.stop, self.out, settle))
            for i in range(runners)
        ]
        self.children: list[Any] = []

    def start(self, beats: bool = True, nodes: bool = True) -> None:
        """Start the heart-beating children, the node-running ones, or both."""
        for process in (self.beaters if beats else []) + (self.runners if nodes else []):
            process.start()
            self.children.append(process)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        for _ in self.children:  # each child's figures join this process's
            got = self.out.get(timeout=180)
            self.errors += got["errors"]
            if got["kind"] == "beats":
                self.beat_lags += got["lags"]
            else:
                self.clock.merge(got)
                self.nodes_done += got["nodes_done"]
        for process in self.children:
            process.join(timeout=60)


def p99_by_where(clock: PassClock, passes: int) -> dict[str, list[float]]:
    """Per step that ran them (``PassClock.label``): the passes' wall p99 (the one pass's time where only one ran)
    and how many ran."""
    out: dict[str, list[float]] = {}
    for where, count in sorted(Counter(clock.where[:passes]).items()):
        times = [ms for ms, at in zip(clock.held_ms[:passes], clock.where[:passes], strict=True) if at == where]
        out[where] = [round(pct(times, 0.99) if len(times) > 1 else times[0], 1), count]
    return out


def mean_of(values: list[float], picked: list[int]) -> float:
    return round(sum(values[i] for i in picked) / len(picked), 1)


def wall_split(clock: PassClock, passes: int) -> dict[str, dict[str, float]]:
    """Where the wall time of the loaded passes went: the mean of each part over the passes at the median (the
    middle 10%) and over the slowest 1%: own CPU, runnable waiting for a CPU, off the CPU (PostgreSQL's answers, a
    row lock, the GIL) and, overlapping the first and third, inside statements."""
    order = sorted(range(passes), key=lambda i: clock.held_ms[i])
    groups = {"median": order[int(passes * 0.45) : max(int(passes * 0.55), int(passes * 0.45) + 1)]}
    groups["slowest_1pct"] = order[-max(1, passes // 100) :]
    out: dict[str, dict[str, float]] = {}
    for name, picked in groups.items():
        if not picked:
            continue
        wall, cpu, runq = (
            mean_of(clock.held_ms, picked),
            mean_of(clock.cpu_ms, picked),
            mean_of(clock.runq_ms, picked),
        )
        out[name] = {
            "wall": wall,
            "cpu": cpu,
            "runqueue": runq,
            "off_cpu": round(wall - cpu - runq, 1),
            "in_statements": mean_of(clock.db_ms, picked),
        }
    return out


def table_bytes(engine: sa.Engine) -> dict[str, int]:
    """Each table's size with its indexes and TOAST (``pg_total_relation_size``), dead rows included: what the load
    costs on disk until a vacuum reclaims it."""
    query = sa.text(
        "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind IN ('r', 'm')"
    )
    with engine.connect() as connection:
        return {name: int(size) for name, size in connection.execute(query)}


def heap_free_bytes(engine: sa.Engine) -> dict[str, int]:
    """Each table's free space inside its own pages (``pgstattuple``; {} where the extension is missing): room that
    ``table_bytes`` counts as grown though no row holds it. Concurrent inserts (the API's) make PostgreSQL extend a
    table by many pages at once, which the next inserts fill, and fillfactor keeps room on each page for updates."""
    query = sa.text(
        "SELECT c.relname, (pgstattuple(c.oid)).free_space FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
    )
    try:
        with engine.begin() as connection:
            connection.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
            return {name: int(free) for name, free in connection.execute(query)}
    except sa.exc.DBAPIError:
        return {}


def in_use(sizes: dict[str, int], free: dict[str, int]) -> int:
    return sum(sizes.values()) - sum(free.values())


def count_jobs(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(sa.select(sa.func.count()).select_from(Job)) or 0)


def growth_per_1000(
    before: dict[str, int],
    after: dict[str, int],
    finished: int,
    submitted: int = 0,
    per_submission: dict[str, float] | None = None,
) -> dict[str, float]:
    """KiB per 1,000 finished jobs of each table that grew by 64 KiB or more, largest first; with ``per_submission``
    (each table's bytes per submission), less ``submitted`` times those."""
    per_submission = per_submission or {}
    grown = {t: after.get(t, 0) - before.get(t, 0) - submitted * per_submission.get(t, 0.0) for t in after}
    return {
        t: round(b / 1024 / finished * 1000, 1)
        for t, b in sorted(grown.items(), key=lambda i: -i[1])
        if abs(b) >= 64 * 1024 and finished
    }


def table_writes(engine: sa.Engine) -> dict[str, dict[str, int]]:
    """Each table's rows inserted, updated (and of those, HOT: no new index entries, the new version on the same
    page), deleted so far (``pg_stat_user_tables``): which writes make the growth."""
    query = sa.text(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables "
        "WHERE schemaname = 'public'"
    )
    with engine.connect() as connection:
        connection.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        return {
            row[0]: {"ins": row[1], "upd": row[2], "hot": row[3], "del": row[4]} for row in connection.execute(query)
        }


def writes_per_job(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], finished: int
) -> dict[str, Any]:
    """Each written table's row writes during the load per finished job (submissions' inserts included)."""
    out: dict[str, Any] = {}
    for table, counts in sorted(after.items()):
        delta = {k: v - before.get(table, {}).get(k, 0) for k, v in counts.items()}
        if finished and any(delta.values()):
            out[table] = {k: round(v / finished, 2) for k, v in delta.items()}
    return out


def count_finished(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.scalar(sa.select(sa.func.count()).where(Job.state == JobState.succeeded.value)) or 0)


def queue_backlog(settings: Settings, data: str, jobs: int, rng: random.Random) -> None:
    """``jobs`` queued jobs, inserted as the API inserts them (``mark_dispatched``: as if submitted earlier)."""
    context = team_areas(settings, TEAM).context()
    with session_scope(settings.database_url) as session:
        for i in range(jobs):
            raw = train_spec(data, rng.choice(GANGS), f"backlog-{i}")
            create_job(session, settings=settings, team=TEAM, spec=parse_spec(raw, **context), raw=raw)


def mark_dispatched(settings: Settings) -> None:
    with session_scope(settings.database_url) as session:
        session.execute(sa.update(Job).values(dispatched_at=sa.func.now()))


def fill_cluster(settings: Settings) -> int:
    """Untimed passes until one starts nothing: the hosts take their first jobs from the backlog (the cluster as it
    runs when the load begins: full, 10 x hosts jobs queued), and this process's statements are compiled. Returns
    the jobs started."""
    started = 0
    while granted := scheduler.schedule(settings):
        started += len(granted)
    return started


async def api_load(
    base: str, token: str, data: str, args: argparse.Namespace, rng: random.Random
) -> tuple[dict[str, list[float]], list[str], float]:
    """``--clients`` clients, each cycling POST /v1/jobs, GET /v1/jobs/{id}, GET /healthz, paced so the submissions
    total ``--rate`` per second (closed loop: a client whose requests take longer goes as fast as it can, and the
    achieved rate is reported). Returns latencies, errors and the achieved submissions per second."""
    lat: dict[str, list[float]] = {"post": [], "get": [], "healthz": []}
    errors: list[str] = []
    ids: list[str] = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=120, trust_env=False
    ) as client:
        first = await client.post("/v1/jobs", json=train_spec(data, (1, 1), "first"))
        if first.status_code != 201:
            raise SystemExit(f"the first submission was refused ({first.status_code}): {first.text}")
        ids.append(first.json()["id"])

        async def one(route: str, i: int) -> None:
            job_id = rng.choice(ids) if route == "get" else ""
            spec = train_spec(data, rng.choice(GANGS), f"load-{i}") if route == "post" else {}
            took, response, error = await timed(client, route, job_id, spec)
            if error is not None:
                errors.append(error)
                return
            lat[route].append(took)
            if route == "post" and response is not None:
                ids.append(response.json()["id"])

        start = time.monotonic()
        period = args.clients / args.rate

        async def client_loop(k: int) -> None:
            i = 0
            while time.monotonic() - start < args.seconds:
                slot = start + (i + k / args.clients) * period
                await asyncio.sleep(max(0.0, slot - time.monotonic()))
                for route in lat:
                    await one(route, i * args.clients + k)
                i += 1

        await asyncio.gather(*(client_loop(k) for k in range(args.clients)))
        took = time.monotonic() - start
    return lat, errors, len(lat["post"]) / took


def load_process(base: str, token: str, data: str, args: argparse.Namespace, seed: int, out: Any) -> None:
    """A child process: ``api_load``, its figures sent to ``out``. The load's clients are the API's users, not the
    worker: run in the measuring process, their event loop held the GIL against the passes timed in its node
    threads (each statement's return waits for the interpreter), which no worker process has to share."""
    lowest_priority()
    try:
        out.put(("ok", asyncio.run(api_load(base, token, data, args, random.Random(seed)))))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put(("error", f"{type(err).__name__}: {err}"))


def run_load(base: str, token: str, data: str, args: argparse.Namespace, seed: int) -> Any:
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    process = spawn.Process(target=load_process, args=(base, token, data, args, seed, out))
    process.start()
    try:
        status, got = out.get(timeout=args.seconds + 600)
    finally:
        process.join(timeout=60)
    if status != "ok":
        raise SystemExit(f"the API load failed: {got}")
    return got


def hog(seconds: float) -> None:
    """A child process spinning at normal priority for ``seconds``: the CPU hog beside the API and PostgreSQL."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def start_hogs(seconds: float) -> list[Any]:
    """Twice as many spinning processes as CPUs, for ``seconds``: the API, the scheduler and PostgreSQL starved."""
    spawn = multiprocessing.get_context("spawn")
    hogs = [spawn.Process(target=hog, args=(seconds,), daemon=True) for _ in range(2 * (os.cpu_count() or 1))]
    for process in hogs:
        process.start()
    return hogs


def wait_down(settings: Settings, name: str, timeout: float) -> float | None:
    """Seconds until ``name`` reads down (not up), or None after ``timeout``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        with session_scope(settings.database_url) as session:
            if session.scalar(sa.select(Host.state).where(Host.name == name)) != HostState.up.value:
                return round(time.monotonic() - began, 1)
        time.sleep(0.5)
    return None


def count_lost(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        lost = sa.select(sa.func.count()).select_from(JobNode).where(JobNode.state == NodeState.lost.value)
        return int(session.scalar(lost) or 0)


def count_down(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return int(
            session.scalar(sa.select(sa.func.count()).select_from(Host).where(Host.state != HostState.up.value)) or 0
        )


def run_scale(args: argparse.Namespace, hosts: int, jobs: int) -> dict[str, Any]:
    rng = random.Random(hosts)
    # a database of its own on the server ``--postgres`` names (never the tests' shared one), dropped afterwards
    database = contextlib.ExitStack()
    url = database.enter_context(own_database(args.postgres, "cp"))
    proc, sim, clock = None, None, PassClock()
    passes, quiet, quiet_cpu, judged_during, lost_during, started_jobs = 0, list[float](), list[float](), 0, 0, 0
    stopped_down_s: float | None = None
    statements: StatementClock | None = None
    names = [f"sim-{i:04d}" for i in range(hosts)]
    settings: Settings | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="llmjobs-cp-") as tmp:
            # host_stale_after_s as deployed (30 s): the host verdicts must hold under the load. One team submits the
            # whole load, so the per-team unfinished-job limit (default 200) is off; its priorities (the default, 0)
            # are under the ceiling
            fast = {"LLMJOBS_TEAM_MAX_ACTIVE_JOBS": "0"}
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")},
                **fast,
                "LLMJOBS_VAR_DIR": tmp,
                "LLMJOBS_DATABASE_URL": url,
                "LLMJOBS_BROKER_URL": args.redis,
                "PYTHONPATH": str(ROOT),
            }
            settings = Settings(
                var_dir=Path(tmp),
                database_url=url,
                broker_url=args.redis,
                redis_url=None,
                data_roots=[],
                runs_dir=None,
                team_max_active_jobs=0,
            )
            prepare(settings)
            data = tiny_data(settings)
            started = time.monotonic()
            for name in names:
                register_host(
                    settings,
                    name=name,
                    device_type="cuda",
                    devices=DEVICES,
                    queues=[settings.queue_for("cuda"), f"host.{name}"],
                    address="127.0.0.1",
                    device_memory=80 * 2**30,
                )
            engine = sa.create_engine(url)
            empty_by_table, empty_free = table_bytes(engine), heap_free_bytes(engine)
            empty = sum(empty_by_table.values())
            queue_backlog(settings, data, jobs, rng)
            # what one submission's own rows take (its job, spec and event rows with their index entries), measured
            # on the backlog's inserts: the load's submissions are subtracted from the growth at this rate
            backlog = table_bytes(engine)
            submission_bytes = (sum(backlog.values()) - empty) / jobs
            submission_in_use = (in_use(backlog, heap_free_bytes(engine)) - in_use(empty_by_table, empty_free)) / jobs
            submission_by_table = {t: (b - empty_by_table.get(t, 0)) / jobs for t, b in backlog.items()}
            mark_dispatched(settings)
            # the backlog takes minutes at 1,000 hosts, past host_stale_after_s: without a beat here the fill found
            # no live host and the cluster filled during the measured load instead (passes of hundreds of grants)
            beat_many(settings, names)
            started_jobs = fill_cluster(settings)
            setup_s = time.monotonic() - started
            with session_scope(settings.database_url) as session:
                token = create_token(session, team=TEAM)
            if args.gc == "settled":  # this process's passes stand for a worker's: settled as a worker settles
                settle_heap()
            clock.install()
            sim = SimulatedHosts(settings, names, args.runners, clock, settle=args.gc == "settled")
            port = free_port()
            proc = start_api(env, port, Path(tmp) / "api.log")
            sim.start(nodes=False)  # the hosts beat: live through the submissions-only phase
            api_submission_bytes = None
            if args.submission_seconds:  # what a submission costs through the API, with no job finishing meanwhile
                before, submitted0 = table_bytes(engine), count_jobs(engine)
                phase = argparse.Namespace(**{**vars(args), "seconds": args.submission_seconds})
                run_load(f"http://127.0.0.1:{port}", token, data, phase, hosts + 1)
                time.sleep(1.0)  # the dispatcher's last wake
                taken = count_jobs(engine) - submitted0
                api_submission_bytes = (sum(table_bytes(engine).values()) - sum(before.values())) / taken
            size0, finished0, jobs0 = table_bytes(engine), count_finished(settings), count_jobs(engine)
            free0 = heap_free_bytes(engine)
            writes0 = table_writes(engine)
            sim.start(beats=False)
            hogs = start_hogs(args.starve) if args.starve else []
            lat, errors, achieved = run_load(f"http://127.0.0.1:{port}", token, data, args, hosts)
            for process in hogs:
                process.join(timeout=args.starve + 60)
            # one reconciler pass with the hosts still heart-beating and the API up: what the leader does every
            # interval. (Measured after the simulator stopped, every host whose beats lagged was judged dead and its
            # jobs recovered: a mass host-death pass, not the steady one.)
            down0 = count_down(settings)
            clock.label = "reconciler"
            began, began_cpu = time.perf_counter(), time.thread_time()
            with StatementClock().recording() as statements:
                reconcile_once(settings)
            reconcile_s, reconcile_cpu_s = time.perf_counter() - began, time.thread_time() - began_cpu
            hosts_judged_down = count_down(settings) - down0
            judged_during = (Path(tmp) / "api.log").read_text(errors="replace").count("; marked down")
            lost_during = count_lost(settings)
            if args.starve:  # then one host really stops: judged down once the service has caught up
                sim.silenced.set()
                stopped_down_s = wait_down(settings, SILENCED, 3 * settings.host_stale_after_s + 60)
            sim.close()
            proc.terminate()
            proc.wait(timeout=60)
            proc = None
            time.sleep(1.0)  # the backends' table counters reach pg_stat_user_tables within a second
            size1, finished1, jobs1 = table_bytes(engine), count_finished(settings), count_jobs(engine)
            free1 = heap_free_bytes(engine)
            writes1 = table_writes(engine)
            engine.dispose()
            # the API's leader judged the hosts every presence_interval_s through the load (core.host_verdicts):
            # counted above, before any host was stopped on purpose
            passes = len(clock.held_ms)
            quiet, quiet_cpu = clock.quiet(settings, args.quiet_passes)
    finally:
        clock.uninstall()
        if sim is not None:
            sim.close()
        if proc is not None:
            proc.kill()
        if settings is not None:
            get_engine(settings.database_url).dispose()  # this process's pooled connections, before the drop
        database.close()  # the drop
        queues = [f"host.{name}" for name in names] + ([settings.queue_for("cuda")] if settings else [])
        redis.Redis.from_url(args.redis).delete(*queues)  # the messages nobody consumed: only this run's queues
    finished, submitted = finished1 - finished0, jobs1 - jobs0
    grown = sum(size1.values()) - sum(size0.values())
    grown_by_finishing = grown - submitted * submission_bytes  # the submissions' own rows are not the jobs' runs
    # the same in bytes that rows hold (dead ones included), pages' free room left out at both ends and in the
    # submissions' own cost: what the jobs' runs wrote, not what PostgreSQL allocated ahead of the inserts
    in_use_by_finishing = in_use(size1, free1) - in_use(size0, free0) - submitted * submission_in_use
    row: dict[str, Any] = {
        "hosts": hosts,
        "devices": hosts * DEVICES,
        "jobs_queued": jobs,
        "setup_s": round(setup_s, 1),
        "jobs_started_before_load": started_jobs,
        "submissions_per_s": round(achieved, 1),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "passes": passes,
        "grants": clock.grants,
        "schedule_p50_ms": round(pct(clock.held_ms[:passes], 0.5), 1),
        "schedule_p99_ms": round(pct(clock.held_ms[:passes], 0.99), 1),
        "schedule_cpu_p50_ms": round(pct(clock.cpu_ms[:passes], 0.5), 1),
        "schedule_cpu_p99_ms": round(pct(clock.cpu_ms[:passes], 0.99), 1),
        # the slowest 1% of passes: their times and how many gangs each granted
        "slowest_passes_ms_grants": sorted(
            ((round(ms, 1), n) for ms, n in zip(clock.held_ms[:passes], clock.pass_grants[:passes], strict=True)),
            reverse=True,
        )[: max(1, passes // 100)],
        "schedule_wait_p99_ms": round(pct(clock.wait_ms, 0.99), 1),
        "schedule_wall_split_ms": wall_split(clock, passes),
        "schedule_p99_ms_by_where": p99_by_where(clock, passes),
        "schedule_quiet_p50_ms": round(pct(quiet, 0.5), 1),
        "schedule_quiet_p99_ms": round(pct(quiet, 0.99), 1),
        "schedule_quiet_cpu_p99_ms": round(pct(quiet_cpu, 0.99), 1),
        "nodes_finished": sim.nodes_done if sim else 0,
        "jobs_finished": finished,
        "heartbeat_lag_p99_s": round(pct(sim.beat_lags, 0.99), 2) if sim and sim.beat_lags else None,
        "heartbeat_lag_max_s": round(max(sim.beat_lags), 2) if sim and sim.beat_lags else None,
        "hosts_judged_down_during_load": judged_during,
        "nodes_lost": lost_during,
        "starved_s": args.starve,
        "stopped_host_judged_down_after_s": stopped_down_s if args.starve else None,
        "reconcile_s": round(reconcile_s, 3),
        "reconcile_cpu_s": round(reconcile_cpu_s, 3),  # its own CPU time (this thread), whatever shares the CPUs
        "hosts_judged_down_by_that_pass": hosts_judged_down,
        # that pass's time inside statements, and its slowest statements (ms, the first words)
        "reconcile_in_statements_s": round(sum(statements.by_statement.values()), 3) if statements else None,
        "reconcile_slowest_statements_ms": statements.slowest() if statements else [],
        "db_growth_mib": round(grown / 2**20, 2),
        "jobs_submitted": submitted,
        "submission_kib": round(submission_bytes / 1024, 2),
        # one submission's whole cost through the API (its rows, the dispatcher's mark, the passes' reasons), from
        # --submission-seconds of submissions before any node ran, and the growth per finished job less that
        "submission_kib_through_api": round(api_submission_bytes / 1024, 2) if api_submission_bytes else None,
        "db_growth_less_api_submissions_mib_per_1000_finished": round(
            (grown - submitted * api_submission_bytes) / 2**20 / finished * 1000, 2
        )
        if finished and api_submission_bytes
        else None,
        "db_growth_mib_per_1000_finished": round(grown_by_finishing / 2**20 / finished * 1000, 2) if finished else None,
        "db_growth_in_use_mib_per_1000_finished": round(in_use_by_finishing / 2**20 / finished * 1000, 2)
        if finished and free1
        else None,
        # the free room inside each table's pages grown during the load (pages allocated ahead, fillfactor's room)
        "db_free_room_kib_per_1000_finished_by_table": growth_per_1000(free0, free1, finished),
        "db_growth_with_submissions_mib_per_1000_finished": round(grown / 2**20 / finished * 1000, 2)
        if finished
        else None,
        "db_growth_kib_per_1000_finished_by_table": growth_per_1000(size0, size1, finished),
        # the same less each table's share of the submissions' rows (what job_specs, written once at submission, and
        # the other tables grow by per finished job beyond the submissions)
        "db_growth_kib_per_1000_finished_by_table_less_submissions": growth_per_1000(
            size0, size1, finished, submitted, submission_by_table
        ),
        "submission_kib_by_table": {
            t: round(b / 1024, 2) for t, b in sorted(submission_by_table.items(), key=lambda i: -i[1]) if b >= 16
        },
        "db_row_writes_per_finished_job": writes_per_job(writes0, writes1, finished),
        "gc": args.gc,
        "errors": len(errors) + len(sim.errors if sim else []),
    }
    for route, values in lat.items():
        row[f"{route}_p99_ms"] = round(pct(values, 0.99), 1)
        row[f"{route}_n"] = len(values)
    row["get_p99_ratio"] = round(row["get_p99_ms"] / row["healthz_p99_ms"], 2)
    row["post_p99_ratio"] = round(row["post_p99_ms"] / row["healthz_p99_ms"], 2)
    for line in sorted(set(errors + (sim.errors if sim else [])))[:8]:
        print("error:", line, flush=True)
    print(json.dumps(row), flush=True)
    return row


# The targets at the largest scale (growth: every scale), the simulator and the clients deprioritised.
TARGETS = {
    "schedule_cpu_p99_ms": 50,
    "schedule_p99_ms": 200,
    "heartbeat_lag_p99_s": 5,
    "hosts_judged_down_during_load": 0,
    "hosts_judged_down_by_that_pass": 0,
    "nodes_lost": 0,
    "reconcile_s": 1.0,
    "db_growth_mib_per_1000_finished": 10,  # at every scale
}


def targets_met(rows: list[dict[str, Any]], curves: dict[str, Any]) -> dict[str, bool]:
    top = rows[-1]
    met = {key: top.get(key) is not None and top[key] <= limit for key, limit in TARGETS.items()}
    met["db_growth_mib_per_1000_finished"] = all(
        (r["db_growth_mib_per_1000_finished"] or 0) <= TARGETS["db_growth_mib_per_1000_finished"] for r in rows
    )
    met["api_ratios"] = top["get_p99_ratio"] <= 2 and top["post_p99_ratio"] <= 4
    met["linear"] = all(c["linear"] for c in curves.values())
    if top.get("starved_s"):  # the starvation run: the stopped host is judged down once the service caught up
        met["stopped_host_judged_down"] = top["stopped_host_judged_down_after_s"] is not None
    met["all"] = all(met.values())
    return met


GROWTH_KEYS = (
    "schedule_cpu_p99_ms",
    "schedule_p99_ms",
    "heartbeat_lag_p99_s",
    "get_p99_ms",
    "post_p99_ms",
    "reconcile_s",
    "db_growth_mib_per_1000_finished",
)


def growth(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's factor from one scale to the next, against the hosts' factor."""
    out: dict[str, Any] = {}
    for a, b in itertools.pairwise(rows):
        hosts = b["hosts"] / a["hosts"]
        for key in GROWTH_KEYS:
            if a.get(key) and b.get(key) is not None:
                factor = b[key] / a[key]
                out[f"{key}_{a['hosts']}_to_{b['hosts']}"] = {
                    "factor": round(factor, 2),
                    "hosts_factor": hosts,
                    "linear": factor <= 1.5 * hosts,
                }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="10,100,1000", help="comma-separated host counts, one run each")
    parser.add_argument("--jobs-per-host", type=int, default=10)
    parser.add_argument("--rate", type=float, default=50.0, help="submissions per second (as many GETs and /healthz)")
    parser.add_argument("--clients", type=int, default=20, help="concurrent API clients")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--runners",
        type=int,
        default=2,
        help="child processes running the simulated nodes (one node at a time each, at normal priority: as many "
        "as the pool's threads held the GIL before, so the simulator's own steps take no more CPU than they did)",
    )
    parser.add_argument(
        "--postgres",
        default=DEFAULT_SERVER,
        help="a PostgreSQL server (the database named is only where this run creates and drops its own)",
    )
    parser.add_argument(
        "--redis",
        default=os.environ.get("LLMJOBS_TEST_REDIS_URL", "redis://127.0.0.1:6379/5"),
        help="the broker (this run's queues are deleted after each scale)",
    )
    parser.add_argument(
        "--quiet-passes", type=int, default=20, help="passes timed after the load, nothing else running"
    )
    parser.add_argument(
        "--starve",
        type=float,
        default=0.0,
        help="a CPU hog (2 spinning processes per CPU, normal priority) for this many seconds from the load's start; "
        "then one host stops beating and the time until it is judged down is reported",
    )
    parser.add_argument(
        "--gc",
        choices=("settled", "default"),
        default="settled",
        help="the measuring processes' garbage collector: settled after start-up as the API and workers do "
        "(core.gc_tuning.settle_heap), or CPython's default (the comparison)",
    )
    parser.add_argument(
        "--submission-seconds",
        type=float,
        default=10.0,
        help="submissions only (no node runs) for this long before the load: one submission's cost through the API",
    )
    parser.add_argument("--smoke", action="store_true", help="10 hosts, 100 jobs, 10 submissions/s for 3 s")
    args = parser.parse_args()
    if args.smoke:
        args.hosts, args.rate, args.seconds, args.clients, args.submission_seconds = "10", 10.0, 3.0, 4, 2.0
    scales = [int(h) for h in args.hosts.split(",")]
    rows = [run_scale(args, hosts, hosts * args.jobs_per_host) for hosts in scales]
    curves = growth(rows)
    print(
        json.dumps(
            {
                "bench": "control_plane",
                "smoke": args.smoke,
                "rate": args.rate,
                "seconds": args.seconds,
                "scales": rows,
                "growth": curves,
                "targets": TARGETS,
                "targets_met": targets_met(rows, curves),
            }
        )
    )


if __name__ == "__main__":
    main()
