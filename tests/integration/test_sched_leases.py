"""Scheduler and recovery on both backends (SQLite and the real PostgreSQL): whole-gang atomic grants, FIFO within a
priority, team limits, refusal of requests that can never fit, pending reasons, GET /v1/hosts, lost hosts re-queue
their jobs, cancels of never-launched nodes, start deadlines, and no double grant under concurrent schedulers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from app.main import create_app
from core.db import session_scope
from core.jobs import request_cancel
from core.models import Event, Host, Job, JobNode, Lease, SchedulerLock, utcnow
from core.nodes import move_nodes
from core.reconciler import reconcile_once
from core.recovery import recover
from core.scheduler import behind_reason, schedule
from core.settings import Settings
from core.states import NodeState
from core_support import (
    auth,
    fresh_postgres_database,
    isolated_settings,
    make_job,
    make_token,
    reset_postgres_database,
    team_dir,
)
from worker.leases import release_node
from worker.node import claim_node, mark_running, record_exit


@pytest.fixture(scope="module")
def postgres_database(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str | None:
    """SQLite: a new file per test (isolated_settings). PostgreSQL: the module's database, reset to its state at
    head before each test (a new database and its drop took 3-6 s per test at load 21, the reset 0.1 s)."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("postgres_database")
    reset_postgres_database(url)
    return url


def _settings(tmp_path: Path, db_url: str | None, **overrides: Any) -> Settings:
    return isolated_settings(tmp_path, db_url, **overrides)


@pytest.fixture
def settings(tmp_path: Path, db_url: str | None) -> Settings:
    return _settings(tmp_path, db_url)


def add_host(settings: Settings, name: str, devices: int, device_type: str = "cpu", address: str = "127.0.0.1") -> None:
    with session_scope(settings.database_url) as session:
        session.add(
            Host(
                name=name,
                device_type=device_type,
                devices=devices,
                device_ids=list(range(devices)),
                queue=f"host.{name}",
                address=address,
                state="up",
                info={},
            )
        )


def job(settings: Settings, nproc: int = 1, nnodes: int = 1, team: str = "t", **fields: Any) -> str:
    return make_job(settings, team=team, resources={"nproc_per_node": nproc, "nnodes": nnodes}, **fields)


def rows(settings: Settings, *ids: str) -> list[Job]:
    with session_scope(settings.database_url) as session:
        return [session.get(Job, i) for i in ids]  # type: ignore[misc]


def reasons(settings: Settings) -> dict[str, str | None]:
    with session_scope(settings.database_url) as session:
        return dict(session.execute(select(Job.id, Job.pending_reason)).tuples().all())


def nodes(settings: Settings, job_id: str) -> list[JobNode]:
    with session_scope(settings.database_url) as session:
        return list(
            session.scalars(
                select(JobNode).where(JobNode.job_id == job_id).order_by(JobNode.attempt, JobNode.node_rank)
            )
        )


def finish(settings: Settings, job_id: str) -> None:
    """What a worker does when a job's processes have exited: mark it done, release its nodes' leases."""
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(state="succeeded"))
        session.execute(update(JobNode).where(JobNode.job_id == job_id).values(state="exited", exit_code=0))
    for node in nodes(settings, job_id):
        assert release_node(settings, node.id)


def test_three_two_slot_jobs_on_four_slots(settings: Settings) -> None:
    add_host(settings, "h1", 4)
    a, b, c = (job(settings, nproc=2) for _ in range(3))
    assert [g.job_id for g in schedule(settings)] == [a, b]
    ja, jb, jc = rows(settings, a, b, c)
    assert (ja.state, jb.state, jc.state) == ("starting", "starting", "queued")
    assert jc.pending_reason == "waiting for 2 free cpu devices on one host; host h1 has 0 free"
    assert sorted(nodes(settings, a)[0].devices + nodes(settings, b)[0].devices) == [0, 1, 2, 3]
    finish(settings, a)
    assert [g.job_id for g in schedule(settings)] == [c]
    assert nodes(settings, c)[0].devices == nodes(settings, a)[0].devices
    assert rows(settings, c)[0].pending_reason is None


def test_a_long_queue_is_counted_in_steps_so_one_start_rewrites_few_reasons(settings: Settings) -> None:
    """Exact counts would change every waiting job's reason whenever one ahead starts (a row write per waiting job
    per pass); from 5 on, in 1-2-5 steps, only the jobs near the front and those crossing a step change."""
    add_host(settings, "h1", 1)
    ids = [job(settings) for _ in range(60)]
    assert [g.job_id for g in schedule(settings)] == [ids[0]]
    front, middle, far = rows(settings, ids[5], ids[15], ids[45])
    assert (
        front.pending_reason
        == behind_reason(4, "cpu")
        == ("waiting behind 4 jobs (higher priority or queued earlier) for cpu devices")
    )
    assert middle.pending_reason == "waiting behind 10+ jobs (higher priority or queued earlier) for cpu devices"
    assert far.pending_reason == "waiting behind 20+ jobs (higher priority or queued earlier) for cpu devices"
    finish(settings, ids[0])
    before = reasons(settings)
    assert [g.job_id for g in schedule(settings)] == [ids[1]]
    front, middle, far = rows(settings, ids[5], ids[15], ids[45])
    assert front.pending_reason == behind_reason(3, "cpu")
    assert middle.pending_reason == behind_reason(13, "cpu") == behind_reason(14, "cpu")  # not rewritten
    assert far.pending_reason == "waiting behind 20+ jobs (higher priority or queued earlier) for cpu devices"
    after = reasons(settings)
    rewritten = sorted(ids.index(i) for i in before if before[i] != after[i])
    # the start, the newly blocked job, 4 exact counts, the jobs crossing a step (5+ -> 4, 10+ -> 5+, 20+ -> 10+)
    # and the pass's window's last: 9 rows of the 50 in the window, where exact counts up to 20 rewrote 22
    assert rewritten == [1, 2, 3, 4, 5, 6, 11, 21, 50], rewritten
    assert "behind 1000+ jobs" in behind_reason(1234, "cpu") and "behind 50+ jobs" in behind_reason(99, "cpu")
    assert "behind 5+ jobs" in behind_reason(9, "cpu") and "behind 2 jobs" in behind_reason(2, "cpu")


def test_priority_first_then_fifo_and_no_backfill(settings: Settings) -> None:
    add_host(settings, "h1", 2)
    low1, big, high, low2 = job(settings), job(settings, nproc=2), job(settings, priority=5), job(settings)
    assert [g.job_id for g in schedule(settings)] == [high, low1]
    big_row, low2_row = rows(settings, big, low2)
    assert "waiting for 2 free cpu devices" in (big_row.pending_reason or "")
    assert low2_row.pending_reason == "waiting behind 1 job (higher priority or queued earlier) for cpu devices"
    finish(settings, high)
    assert schedule(settings) == []  # one device free, but the 2-device job queued earlier comes first
    finish(settings, low1)
    assert [g.job_id for g in schedule(settings)] == [big]


def test_teams_take_turns_within_a_priority(settings: Settings) -> None:
    """A team's backlog does not push another team's later job behind all of it (core.scheduler.fair_order); a
    higher priority still comes first, and each team's own jobs stay FIFO."""
    add_host(settings, "h1", 3)
    backlog = [job(settings, team="red") for _ in range(50)]
    blue, urgent = job(settings, team="blue"), job(settings, team="red", priority=5)
    assert [g.job_id for g in schedule(settings)] == [urgent, blue, backlog[0]]
    (waiting,) = rows(settings, backlog[1])
    assert "waiting for 1 free cpu devices on one host" in (waiting.pending_reason or "")
    finish(settings, blue)
    later = job(settings, team="blue")
    assert [g.job_id for g in schedule(settings)] == [later]  # blue holds none now, red holds two


def test_gang_is_all_or_nothing_across_hosts(settings: Settings) -> None:
    add_host(settings, "h1", 2, address="10.0.0.1")
    add_host(settings, "h2", 2, address="10.0.0.2")
    blocker = job(settings)
    schedule(settings)
    gang = job(settings, nproc=2, nnodes=2)
    assert schedule(settings) == []
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Lease).where(Lease.job_id == gang)).all() == []  # no partial grant
    assert "waiting for 2 hosts with 2 free cpu devices each (1 have enough)" in (
        rows(settings, gang)[0].pending_reason or ""
    )
    finish(settings, blocker)
    assert [g.hosts for g in schedule(settings)] == [["h1", "h2"]]
    n0, n1 = nodes(settings, gang)
    assert (n0.node_rank, n1.node_rank, n0.devices, n1.devices) == (0, 1, [0, 1], [0, 1])
    assert n0.master_addr == n1.master_addr == "10.0.0.1" and n0.master_port == n1.master_port
    assert settings.rdzv_port_base <= n0.master_port < settings.rdzv_port_base + settings.rdzv_port_count


def test_team_limit(tmp_path: Path, db_url: str | None) -> None:
    settings = _settings(tmp_path, db_url, team_device_limit=2)
    add_host(settings, "h1", 4)
    a1, a2, b1 = job(settings, nproc=2, team="a"), job(settings, nproc=2, team="a"), job(settings, nproc=2, team="b")
    assert [g.job_id for g in schedule(settings)] == [a1, b1]
    assert rows(settings, a2)[0].pending_reason == "team a holds 2 of its 2 devices; this job needs 2"


def test_never_fits_is_refused_and_hosts_show_holders(settings: Settings) -> None:
    add_host(settings, "h1", 4)
    add_host(settings, "h2", 2)
    (team_dir(settings, "t") / "in.jsonl").write_text("{}\n")
    (team_dir(settings, "t") / "tok").mkdir()  # admission: the tokenizer directory must exist
    body = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"}
    token, other = make_token(settings, "t"), make_token(settings, "other")
    with TestClient(create_app(settings, reconcile=False)) as client:
        for resources, field, text in [
            ({"nproc_per_node": 8}, "resources.nproc_per_node", "largest cpu host has 4"),
            ({"nproc_per_node": 3, "nnodes": 2}, "resources.nnodes", "only 1 cpu hosts"),
            ({"device_type": "npu"}, "resources.device_type", "no npu host is registered"),
        ]:
            r = client.post("/v1/jobs", json={**body, "resources": resources}, headers=auth(token))
            assert r.status_code == 422 and r.json()["field"] == field and text in r.json()["message"], r.json()
        ok = client.post("/v1/jobs", json={**body, "resources": {"nproc_per_node": 3}}, headers=auth(token)).json()
        assert ok["state"] == "queued"  # the request only commits; the API's dispatcher loop schedules it
        deadline = time.monotonic() + 10
        while ok["state"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.05)
            ok = client.get(f"/v1/jobs/{ok['id']}", headers=auth(token)).json()
        assert ok["state"] == "starting"  # h1 has 3 free
        hosts = {h["name"]: h for h in client.get("/v1/hosts", headers=auth(token)).json()["data"]}
        assert hosts["h1"]["health"] == "up" and hosts["h1"]["free"] == 1
        assert [d["job_id"] for d in hosts["h1"]["devices"]] == [ok["id"]] * 3 + [None]
        theirs = client.get("/v1/hosts", headers=auth(other)).json()["data"][0]
        assert [d["held"] for d in theirs["devices"]] == [True, True, True, False] and theirs["devices"][0][
            "job_id"
        ] is None


def test_concurrent_schedulers_never_double_grant(settings: Settings) -> None:
    add_host(settings, "h1", 4)
    ids = [job(settings) for _ in range(10)]
    barrier, errors = threading.Barrier(6), []

    def run() -> None:
        barrier.wait()
        try:
            schedule(settings)
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(r.state == "starting" for r in rows(settings, *ids)) == 4
    with session_scope(settings.database_url) as session:
        assert sorted(session.scalars(select(Lease.device))) == [0, 1, 2, 3]


def test_redelivered_message_claims_nothing(settings: Settings) -> None:
    add_host(settings, "h1", 1)
    j = job(settings)
    schedule(settings)
    assert claim_node(settings, j, 1, 0, "h1") is not None
    assert claim_node(settings, j, 1, 0, "h1") is None  # the same message again
    assert claim_node(settings, j, 1, 0, "h2") is None  # or for another host


def test_a_claim_retried_after_its_lost_answer_takes_its_node(settings: Settings) -> None:
    add_host(settings, "h1", 1)
    j = job(settings)
    schedule(settings)
    claimed_at = utcnow()
    first = claim_node(settings, j, 1, 0, "h1", claimed_at)
    assert first is not None
    # the commit went through, its answer was lost: the retry passes the same claimed_at and gets the same node
    assert claim_node(settings, j, 1, 0, "h1", claimed_at) == first
    assert claim_node(settings, j, 1, 0, "h1", utcnow()) is None  # another message's claim does not


def test_a_node_exit_gives_its_devices_back_in_the_same_write(settings: Settings) -> None:
    """The exit record sets ``released_at`` and deletes the node's leases in its own statement and transaction, not
    in a second update of the node's row after the outcome (issue 47: each update is a new row version); a node
    moved meanwhile (lost) keeps its leases for ``release_node``, which the lease sweep calls."""
    add_host(settings, "h1", 2)
    done, lost = job(settings), job(settings)
    assert len(schedule(settings)) == 2
    works = {j: claim_node(settings, j, 1, 0, "h1") for j in (done, lost)}
    for work in works.values():
        assert work is not None
        mark_running(settings, work, 1, ["engine"], "h1")  # no process carries the node's token: none to kill
    with session_scope(settings.database_url) as session:
        move_nodes(session, NodeState.lost, JobNode.job_id == lost, finished_at=utcnow(), reason="host lost")
    for work in works.values():
        record_exit(settings, work, 0, None)  # type: ignore[arg-type]
    (exited,), (gone,) = nodes(settings, done), nodes(settings, lost)
    assert exited.state == "exited" and exited.released_at is not None and exited.released_at == exited.finished_at
    assert gone.state == "lost" and gone.released_at is None
    with session_scope(settings.database_url) as session:
        assert sorted(session.scalars(select(Lease.job_id))) == [lost]
    assert release_node(settings, gone.id)
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Lease)).all() == []


# A registered host stays live (schedulable) STALE_S after its last heartbeat: 5 s was shorter than these tests
# take at load 20 (h2, registered at the start, went stale before the retry's grant); a dead host's heartbeat is
# SILENT old, well past it.
STALE_S = 60
SILENT = timedelta(seconds=10 * STALE_S)


def test_dead_host_requeues_then_exhausts_restarts(tmp_path: Path, db_url: str | None) -> None:
    settings = _settings(tmp_path, db_url, host_stale_after_s=STALE_S, retry_backoff_s=0)  # backoff: test_retry_backoff
    add_host(settings, "h1", 1)
    add_host(settings, "h2", 1)
    j = job(settings, max_restarts=1)
    first = schedule(settings)[0].hosts[0]
    assert claim_node(settings, j, 1, 0, first) is not None  # its worker launched it: the attempt counts
    with session_scope(settings.database_url) as session:
        session.execute(update(Host).where(Host.name == first).values(heartbeat_at=utcnow() - SILENT))
    recover(settings)
    row = rows(settings, j)[0]
    assert row.state == "retrying" and "lost" in nodes(settings, j)[0].state
    second = schedule(settings)[0].hosts[0]
    assert second != first and rows(settings, j)[0].attempt_count == 2
    assert claim_node(settings, j, 2, 0, second) is not None
    with session_scope(settings.database_url) as session:  # the dead host keeps its lease until its worker checks
        assert session.scalar(select(Lease.job_id).where(Lease.host == first)) == j
        session.execute(update(Host).where(Host.name == second).values(heartbeat_at=utcnow() - SILENT))
    recover(settings)
    row = rows(settings, j)[0]
    assert (row.state, row.error_code) == ("failed", "retries_exhausted")


def test_an_attempt_lost_before_its_launch_uses_no_restart(tmp_path: Path, db_url: str | None) -> None:
    """A host restarted between the grant and the launch (a service restart): the attempt started no process, so the
    job is retried without using its budget, up to FREE_UNSTARTED_ATTEMPTS such attempts; then they count."""
    from core.recovery import FREE_UNSTARTED_ATTEMPTS

    settings = _settings(tmp_path, db_url, host_stale_after_s=STALE_S)
    j = job(settings, max_restarts=0)
    for attempt in range(1, FREE_UNSTARTED_ATTEMPTS + 2):
        add_host(settings, f"h{attempt}", 1)
        assert schedule(settings)[0].hosts[0] == f"h{attempt}"
        with session_scope(settings.database_url) as session:
            session.execute(update(Host).values(heartbeat_at=utcnow() - SILENT))
        recover(settings)
        row = rows(settings, j)[0]
        if attempt <= FREE_UNSTARTED_ATTEMPTS:
            assert row.state == "retrying", (attempt, row.state)
        else:
            assert (row.state, row.error_code) == ("failed", "retries_exhausted")
    with session_scope(settings.database_url) as session:
        messages = [e.message for e in session.scalars(select(Event).where(Event.job_id == j, Event.type == "state"))]
    assert any("not counted: attempt 1 started no process; 0 of 1 attempts used" in m for m in messages), messages


def test_cancel_of_unlaunched_nodes_frees_devices(settings: Settings) -> None:
    add_host(settings, "h1", 2)
    j = job(settings, nproc=2)
    schedule(settings)
    with session_scope(settings.database_url) as session:
        assert request_cancel(session, session.get(Job, j)).state == "cancelling"  # type: ignore[arg-type]
    recover(settings)
    assert rows(settings, j)[0].state == "cancelled"
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Lease)).all() == []


def test_start_deadline(settings: Settings) -> None:
    add_host(settings, "h1", 1)
    job(settings)
    late = job(settings, start_deadline_s=0.01)
    reconcile_once(settings)
    row = rows(settings, late)[0]
    assert (row.state, row.error_code) == ("failed", "start_deadline_exceeded")
    assert "waiting for 1 free cpu devices" in (row.error_message or "")


def test_one_pass_grants_many_gangs_whole_and_never_a_device_twice(settings: Settings) -> None:
    """A pass that starts dozens of gangs at once (its writes batched): every granted job holds exactly its devices
    on distinct hosts, no device is held twice, a job that did not fit holds nothing, and node 0's port differs
    between the jobs that share a master host."""
    for i in range(12):
        add_host(settings, f"h{i:02d}", 8, address=f"10.0.0.{i}")
    gangs = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (3, 2)] * 6
    ids = {job(settings, nproc=p, nnodes=n): (n, p) for n, p in gangs}
    granted = {g.job_id: g for g in schedule(settings)}
    assert len(granted) >= 10
    with session_scope(settings.database_url) as session:
        leases = session.scalars(select(Lease)).all()
        all_nodes = session.scalars(select(JobNode)).all()
    assert len({(lease.host, lease.device) for lease in leases}) == len(leases) <= 12 * 8
    ports: dict[str, list[int]] = {}
    for job_id, (nnodes, nproc) in ids.items():
        held = [lease for lease in leases if lease.job_id == job_id]
        mine = sorted((n for n in all_nodes if n.job_id == job_id), key=lambda n: n.node_rank)
        if job_id not in granted:
            assert held == [] and mine == []
            continue
        assert len(held) == nnodes * nproc and [n.node_rank for n in mine] == list(range(nnodes))
        assert len({n.host for n in mine}) == nnodes and granted[job_id].hosts == [n.host for n in mine]
        assert sorted((lease.host, lease.device) for lease in held) == sorted(
            (n.host, d) for n in mine for d in n.devices
        )
        assert {n.master_addr for n in mine} == {f"10.0.0.{int(mine[0].host[1:])}"}
        ports.setdefault(mine[0].host, []).append(mine[0].master_port)
    assert all(len(p) == len(set(p)) for p in ports.values())
    assert all(r.state == ("starting" if r.id in granted else "queued") for r in rows(settings, *ids))


def test_a_job_cancelled_while_the_pass_runs_gets_nothing(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched start skips a job that left the queue after the pass read it: no lease, no node, and its devices
    go to the next pass."""
    from core import scheduler

    add_host(settings, "h1", 2)
    gone, kept = job(settings), job(settings)
    read = scheduler.waiting_jobs

    def read_then_cancel(session: Any, window: int) -> list[scheduler.Waiting]:
        jobs = read(session, window)  # then a cancel lands (on SQLite the pass's lock makes it wait: same session)
        session.execute(update(Job).where(Job.id == gone).values(state="cancelled"))
        return jobs

    monkeypatch.setattr(scheduler, "waiting_jobs", read_then_cancel)
    assert [g.job_id for g in schedule(settings)] == [kept]
    assert nodes(settings, gone) == [] and rows(settings, gone)[0].state == "cancelled"
    monkeypatch.setattr(scheduler, "waiting_jobs", read)
    late = job(settings)
    assert [g.job_id for g in schedule(settings)] == [late]


def test_a_heartbeat_pass_waits_while_a_pass_ran_recently_anywhere(settings: Settings) -> None:
    """The backstop throttle: within ``schedule_backstop_s`` of any pass a heartbeat's pass is skipped even though
    something changed; a plain pass always runs; past the interval the heartbeat passes again. Without a pass ever
    (``passed_at`` unset) a heartbeat passes."""
    settings = settings.model_copy(update={"schedule_backstop_s": 3600})
    add_host(settings, "h1", 1)
    first = job(settings)
    assert [g.job_id for g in schedule(settings, backstop=True)] == [first]
    finish(settings, first)
    second = job(settings)
    assert schedule(settings, backstop=True) == []  # a pass ran a moment ago
    assert rows(settings, second)[0].state == "queued"
    with session_scope(settings.database_url) as session:
        session.execute(update(SchedulerLock).values(passed_at=utcnow() - timedelta(hours=2)))
    assert [g.job_id for g in schedule(settings, backstop=True)] == [second]


def test_a_pass_considers_a_window_of_each_team_and_shape(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """``schedule_window`` jobs of each team and gang shape per pass: another team's or another shape's jobs are
    considered at once however long one team's backlog is, and a pass that started a whole window is followed by
    another in the same call, which starts the rest in order; a pass that did not (a job blocked) is not."""
    from core import scheduler

    settings = settings.model_copy(update={"schedule_window": 2})
    add_host(settings, "h1", 8)
    backlog = [job(settings) for _ in range(6)]
    pair = job(settings, nproc=2)
    other = job(settings, team="u")
    real_pass, passes = scheduler._pass, list[list[str]]()

    def counted(session: Any, settings_: Settings) -> list[Any]:
        grants = real_pass(session, settings_)
        passes.append([g.job_id for g in grants])
        return grants

    monkeypatch.setattr(scheduler, "_pass", counted)
    granted = [g.job_id for g in schedule(settings)]
    assert [sorted(p) for p in passes] == [sorted([*backlog[:2], pair, other]), sorted(backlog[2:4]), backlog[4:5]]
    assert granted == [g for p in passes for g in p]
    assert [r.state for r in rows(settings, *backlog)] == ["starting"] * 5 + ["queued"]


def test_waiting_jobs_are_the_first_of_each_team_and_shape_in_grant_order(settings: Settings) -> None:
    """``waiting_jobs`` (a skip scan of ``ix_jobs_waiting_turn`` and one index range per team and shape) returns what
    its rule says, checked against that rule over every row: of each (team, resources) the first ``window`` waiting
    jobs by priority, then age, then id, all in that order; running jobs, pipelines and rows without resources are
    not among them. Ties in priority and age are in the mix, and the teams and shapes interleave in the index."""
    import random

    from core.scheduler import waiting_jobs

    rng, window = random.Random(7), 3
    shapes = ['{"nnodes": 1, "nproc_per_node": 1}', '{"nnodes": 2, "nproc_per_node": 8}', '{"nproc_per_node": 4}']
    base = utcnow() - timedelta(hours=1)
    with session_scope(settings.database_url) as session:
        for i in range(120):
            session.add(
                Job(
                    id=f"j{i:03d}-{rng.randrange(1000):03d}",
                    team=rng.choice(["a", "b", "c"]),
                    kind=rng.choice(["train"] * 6 + ["pipeline"]),
                    state=rng.choice(["queued", "queued", "retrying", "running", "succeeded"]),
                    spec={},
                    priority=rng.choice([0, 0, 5, 100]),
                    queue="q",
                    run_dir="r",
                    created_at=base + timedelta(seconds=rng.randrange(20)),
                    resources=rng.choice([*shapes, None]) if i % 17 == 0 else rng.choice(shapes),
                )
            )
    with session_scope(settings.database_url) as session:
        everything = session.scalars(select(Job)).all()
        waiting = [j for j in everything if j.state in ("queued", "retrying") and j.kind != "pipeline" and j.resources]
        waiting.sort(key=lambda j: (-j.priority, j.created_at, j.id))
        seen: dict[tuple[str, str | None], int] = {}
        expected = []
        for j in waiting:
            seen[(j.team, j.resources)] = seen.get((j.team, j.resources), 0) + 1
            if seen[(j.team, j.resources)] <= window:
                expected.append(j.id)
        got = waiting_jobs(session, window)
    assert len(expected) > 15 and len(seen) > 6
    assert [w.id for w in got] == expected
    assert all(w.resources is not None for w in got)


def asks(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return session.scalar(select(SchedulerLock.generation).where(SchedulerLock.id == 2)) or 0


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_caller_finding_a_pass_running_asks_for_one_instead_of_waiting(settings: Settings) -> None:
    """PostgreSQL: while the scheduler lock's row is held (a pass running), ``schedule`` returns at once having
    counted an ask, and a heartbeat's backstop pass counts none; the next pass grants what waited."""
    from sqlalchemy import create_engine

    add_host(settings, "h1", 2)
    waiting = job(settings)
    before = asks(settings)
    other = create_engine(settings.database_url)
    try:
        with other.connect() as connection, connection.begin():
            connection.execute(select(SchedulerLock.id).where(SchedulerLock.id == 1).with_for_update())
            began = time.monotonic()
            assert schedule(settings) == []
            assert schedule(settings, backstop=True) == []
            assert time.monotonic() - began < 5
            assert asks(settings) == before + 1
        assert rows(settings, waiting)[0].state == "queued"
        assert [g.job_id for g in schedule(settings)] == [waiting]
    finally:
        other.dispose()


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_the_running_pass_runs_again_for_an_ask_made_during_it(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a job submitted while a pass runs, whose own ``schedule`` call found the lock held and returned,
    is started by the running caller's next pass (it saw the ask count move), not left for the reconciler."""
    from core import scheduler

    add_host(settings, "h1", 2)
    first = job(settings)
    real_pass, late = scheduler._pass, list[str]()
    coalesced: list[list[Any]] = []

    def pass_then_submit(session: Any, settings_: Settings) -> list[Any]:
        grants = real_pass(session, settings_)
        if not late:  # during the first pass, with the lock held: another caller submits and asks
            late.append(job(settings))
            caller = threading.Thread(target=lambda: coalesced.append(schedule(settings)))
            caller.start()
            caller.join(timeout=30)
        return grants

    monkeypatch.setattr(scheduler, "_pass", pass_then_submit)
    assert [g.job_id for g in schedule(settings)] == [first, *late]
    assert coalesced == [[]]


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_pass_skips_the_reasons_of_rows_another_transaction_holds(settings: Settings) -> None:
    """PostgreSQL (SQLite locks the whole database, not rows): a waiting job's row held by another transaction (the
    reconciler marking a queue dispatched) does not make the pass wait (which could deadlock); its reason is written
    by a later pass."""
    from sqlalchemy import create_engine

    add_host(settings, "h1", 1)
    running, held, free = job(settings), job(settings), job(settings)
    assert [g.job_id for g in schedule(settings)] == [running]
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id.in_([held, free])).values(pending_reason=None))
    other = create_engine(settings.database_url)
    try:
        with other.connect() as connection, connection.begin():
            connection.execute(select(Job.id).where(Job.id == held).with_for_update())
            began = time.monotonic()
            assert schedule(settings) == []
            assert time.monotonic() - began < 5
        assert rows(settings, held)[0].pending_reason is None and rows(settings, free)[0].pending_reason
        schedule(settings)
        assert rows(settings, held)[0].pending_reason
    finally:
        other.dispose()
