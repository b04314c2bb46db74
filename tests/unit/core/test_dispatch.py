"""The reconciler: lost messages are re-sent, start deadlines hold. (Pending reasons: core.scheduler's tests.)"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.main import create_app
from core.db import session_scope
from core.dispatch import dispatch_new
from core.models import Job, SchedulerLock, utcnow
from core.reconciler import reconcile_once
from core.settings import Settings
from core_support import auth, isolated_settings, make_job, make_token, team_dir


def _broker_messages(settings: Settings) -> int:
    engine = sa.create_engine(settings.broker_url.removeprefix("sqla+"))
    with engine.connect() as connection:
        count = connection.execute(sa.text("SELECT count(*) FROM kombu_message")).scalar_one()
    engine.dispose()
    return count


def _job(settings: Settings, job_id: str) -> Job:
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_lost_message_is_sent_again(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, redispatch_after_s=60)
    job_id = make_job(settings)  # committed, but its message never went out (say the broker was down)
    assert reconcile_once(settings) == 1
    assert _broker_messages(settings) == 1
    assert _job(settings, job_id).dispatched_at is not None
    assert reconcile_once(settings) == 0  # recently sent: left alone
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).values(dispatched_at=utcnow() - timedelta(seconds=120)))
    assert reconcile_once(settings) == 1 and _broker_messages(settings) == 2


def _passes(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.scalar(sa.select(SchedulerLock.generation)) or 0)  # each scheduling pass adds one


def test_many_lost_messages_cost_one_pass_and_one_message_per_queue(tmp_path: Path) -> None:
    """A message only makes a worker run a whole pass: N waiting jobs must not cost N passes here and N messages."""
    settings = isolated_settings(tmp_path, redispatch_after_s=60)
    ids = [make_job(settings) for _ in range(6)]
    before = _passes(settings)
    assert reconcile_once(settings) == 1  # the one queue, woken once
    assert _passes(settings) == before + 1 and _broker_messages(settings) == 1
    assert all(_job(settings, j).dispatched_at is not None for j in ids)
    assert reconcile_once(settings) == 0


def test_start_deadline_fails_a_waiting_job(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    job_id = make_job(settings, start_deadline_s=5)
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).values(created_at=utcnow() - timedelta(seconds=10)))
    reconcile_once(settings)
    job = _job(settings, job_id)
    assert (job.state, job.error_code) == ("failed", "start_deadline_exceeded")
    assert "start_deadline_s=5" in (job.error_message or "")


def test_dispatch_new_sends_each_new_job_once(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    first, second = make_job(settings), make_job(settings)
    assert dispatch_new(settings) == 2  # no host: both wait, each gets its "job X waits" message
    assert _broker_messages(settings) == 2
    assert all(_job(settings, j).dispatched_at is not None for j in (first, second))
    assert dispatch_new(settings) == 0  # already dispatched: a second pass (or replica) sends nothing


def test_submission_returns_before_scheduling_and_the_loop_dispatches(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, reconcile_interval_s=60)
    (team_dir(settings, "t") / "in.jsonl").write_text("{}\n")
    (team_dir(settings, "t") / "tok").mkdir()  # admission wants a tokenizer directory
    body = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"}
    with TestClient(create_app(settings, reconcile=False)) as client:
        job = client.post("/v1/jobs", json=body, headers=auth(make_token(settings, "t"))).json()
        assert job["state"] == "queued"
        deadline = time.monotonic() + 10  # woken by the submission, long before reconcile_interval_s
        while _sent(settings) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _job(settings, job["id"]).dispatched_at is not None and _broker_messages(settings) == 1


def _sent(settings: Settings) -> int:
    try:
        return _broker_messages(settings)
    except sa.exc.OperationalError:  # kombu creates its tables with the first message
        return 0


def test_a_reconciler_that_has_not_watched_the_hosts_long_enough_marks_none_down(tmp_path: Path) -> None:
    """After a database outage (or on taking the lead) every heartbeat looks old; hosts are judged only once the
    leader has led for host_stale_after_s (Leadership.led_for), which on SQLite is always."""
    from core.leadership import Leadership
    from core.models import Host
    from worker.hosts import register_host

    settings = isolated_settings(tmp_path, host_stale_after_s=5)
    register_host(settings, name="h", device_type="cpu", devices=1, queues=["host.h"])
    with session_scope(settings.database_url) as session:
        session.execute(update(Host).values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    reconcile_once(settings, judge_hosts=False)
    with session_scope(settings.database_url) as session:
        assert session.scalars(sa.select(Host.state)).one() == "up"
    reconcile_once(settings)
    with session_scope(settings.database_url) as session:
        assert session.scalars(sa.select(Host.state)).one() == "down"
    assert Leadership(settings.database_url).led_for() == float("inf")
