"""A retried job waits before its next attempt (``retry_backoff_s``, doubling per attempt, capped): the scheduler
places it only after ``retry_not_before``, says so in its pending reason (shown by the API), and lets other jobs
use the devices meanwhile. An attempt that started no process is retried at once."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from core.db import session_scope
from core.jobs import transition
from core.models import Event, Host, Job, JobNode, utcnow
from core.recovery import end_attempt, retry_backoff
from core.scheduler import retry_reason, schedule
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, make_job, make_token


def _host(settings: Settings, devices: int) -> None:
    with session_scope(settings.database_url) as session:
        session.add(
            Host(
                name="h",
                device_type="cpu",
                devices=devices,
                device_ids=list(range(devices)),
                queue="host.h",
                address="127.0.0.1",
                state="up",
                info={},
            )
        )


def _run_and_fail(settings: Settings, job_id: str, *, started: bool = True) -> str:
    """Grant the job its first attempt, let its worker start it (or not), then end the attempt as a dead rank."""
    granted = schedule(settings)
    assert [(g.job_id, g.attempt) for g in granted] == [(job_id, 1)]
    if started:
        with session_scope(settings.database_url) as session:
            session.execute(update(JobNode).where(JobNode.job_id == job_id).values(started_at=utcnow()))
            session.commit()
            assert transition(session, job_id, JobState.running)
    return end_attempt(settings, job_id, 1, retryable=True, error_code="engine_failed", message="rank 1 exited")


def _job(settings: Settings, job_id: str) -> Job:
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_backoff_doubles_per_attempt_up_to_the_cap(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    assert [retry_backoff(settings, n) for n in (0, 1, 2, 3, 5, 6, 1000)] == [0, 10, 20, 40, 160, 300, 300]
    assert retry_backoff(isolated_settings(tmp_path, retry_backoff_s=0), 3) == 0


def test_a_retried_job_is_placed_only_after_its_time(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, retry_backoff_s=1.5)
    _host(settings, 2)
    job_id = make_job(settings, resources={"nproc_per_node": 1}, max_restarts=2)
    before = utcnow()
    assert _run_and_fail(settings, job_id) == "retrying"
    job = _job(settings, job_id)
    assert job.state == "retrying" and job.retry_not_before is not None
    assert before + timedelta(seconds=1.5) <= job.retry_not_before <= utcnow() + timedelta(seconds=1.5)

    assert schedule(settings) == []  # a device is free, but the retry waits
    job = _job(settings, job_id)
    assert job.state == "retrying" and job.pending_reason == retry_reason(job.retry_not_before, 2)  # type: ignore[arg-type]
    assert job.pending_reason.startswith("retrying after ") and job.pending_reason.endswith(" UTC (attempt 2)")
    with TestClient(create_app_for(settings), headers=auth(make_token(settings, "t"))) as client:
        shown = client.get(f"/v1/jobs/{job_id}").json()
    assert (shown["state"], shown["pending_reason"]) == ("retrying", job.pending_reason)
    with session_scope(settings.database_url) as session:
        said = session.scalar(select(Event.message).where(Event.job_id == job_id, Event.message.like("retrying%")))
    assert said is not None and "(1 of 3 attempts used); next attempt after " in said

    time.sleep(max(0.0, (job.retry_not_before - utcnow()).total_seconds()) + 0.05)  # type: ignore[operator]
    assert [(g.job_id, g.attempt) for g in schedule(settings)] == [(job_id, 2)]
    assert _job(settings, job_id).state == "starting"


def test_a_backing_off_job_holds_back_no_other(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, retry_backoff_s=60)
    _host(settings, 2)
    retried = make_job(settings, resources={"nproc_per_node": 1}, max_restarts=2)
    assert _run_and_fail(settings, retried) == "retrying"
    later = make_job(settings, resources={"nproc_per_node": 1})
    assert [g.job_id for g in schedule(settings)] == [later]  # the device the retry does not take yet
    assert _job(settings, retried).state == "retrying"


def test_an_attempt_that_started_no_process_is_retried_at_once(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, retry_backoff_s=60)
    _host(settings, 2)
    job_id = make_job(settings, resources={"nproc_per_node": 1}, max_restarts=2)
    assert _run_and_fail(settings, job_id, started=False) == "retrying"
    assert _job(settings, job_id).retry_not_before is None
    assert [(g.job_id, g.attempt) for g in schedule(settings)] == [(job_id, 2)]


def test_an_attempt_the_service_stopped_is_retried_at_once(tmp_path: Path) -> None:
    """A worker shutting down (a service restart) ends its attempts: not the job's failure, so no backoff."""
    settings = isolated_settings(tmp_path, retry_backoff_s=60)
    _host(settings, 2)
    job_id = make_job(settings, resources={"nproc_per_node": 1}, max_restarts=2)
    assert [g.job_id for g in schedule(settings)] == [job_id]
    with session_scope(settings.database_url) as session:
        session.execute(update(JobNode).where(JobNode.job_id == job_id).values(started_at=utcnow()))
        session.commit()
    stopped = end_attempt(settings, job_id, 1, retryable=True, error_code="worker_stopped", message="shutdown")
    assert stopped == "retrying" and _job(settings, job_id).retry_not_before is None
    assert [(g.job_id, g.attempt) for g in schedule(settings)] == [(job_id, 2)]


def create_app_for(settings: Settings):  # type: ignore[no-untyped-def]
    from app.main import create_app

    return create_app(settings, reconcile=False)
