"""worker.execute against the real engine on SQLite: a bad input fails without retry and keeps its log tail;
outcome decisions for retryable exits; a redelivered message for a finished job does nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from app.db import session_scope
from app.demo import demo_spec, prepare_demo
from app.models import Attempt, Event, Job
from app.services.jobs import create_job, transition
from app.settings import Settings
from app.states import JobState
from app.testing import isolated_settings, make_job
from engine.spec import parse_spec
from worker.execute import claim, execute_job, finish
from worker.ingest import RunIngestor


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path, ingest_interval_s=0.2)


def _job(settings: Settings) -> Job:
    with session_scope(settings.database_url) as session:
        job = session.get(Job, make_job(settings, max_restarts=1))
        assert job is not None
        return job


@pytest.mark.slow
def test_bad_input_fails_once_with_message_and_log_tail(settings: Settings) -> None:
    demo = prepare_demo(settings.data_roots[0], samples=5)
    with open(demo / "intent_train.jsonl", "a") as f:
        f.write("{this is not json\n")
    raw = {**demo_spec(), "max_restarts": 3}
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team="t", spec=parse_spec(raw, [str(settings.data_roots[0])]), raw=raw)
    assert execute_job(settings, job.id, host="h1") == "failed"
    with session_scope(settings.database_url) as session:
        row = session.get(Job, job.id)
        assert row is not None and row.state == "failed" and row.attempt_count == 1
        assert row.error_code == "bad_input"
        assert "intent_train.jsonl" in (row.error_message or "") and "line 6" in (row.error_message or "")
        assert "intent_train.jsonl" in (row.error_log_tail or "")
        attempt = session.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
        assert attempt.exit_code == 2 and attempt.host == "h1"
        types = [e.type for e in session.scalars(select(Event).where(Event.job_id == job.id).order_by(Event.id))]
    assert types[:3] == ["state", "state", "state"] and "started" in types and "error" in types and types[-1] == "state"
    assert execute_job(settings, job.id, host="h2") == "skipped"  # a redelivered message changes nothing


def _run_to_exit(settings: Settings, job: Job, code: int, tmp_path: Path) -> str:
    work = claim(settings, job.id, "h")
    assert work is not None
    with session_scope(settings.database_url) as session:
        assert transition(session, job.id, JobState.running)
    ingestor = RunIngestor(settings.database_url, job.id, tmp_path / job.id, work.attempt)
    return finish(settings, work, code, None, ingestor, survivors=[])


def test_retryable_exit_is_retried_until_max_restarts(settings: Settings, tmp_path: Path) -> None:
    job = _job(settings)
    assert _run_to_exit(settings, job, 75, tmp_path) == "retrying"
    with session_scope(settings.database_url) as session:
        row = session.get(Job, job.id)
        assert row is not None and row.state == "retrying" and row.dispatched_at is not None
    assert _run_to_exit(settings, job, 75, tmp_path) == "failed"
    with session_scope(settings.database_url) as session:
        row = session.get(Job, job.id)
        assert row is not None and (row.state, row.error_code, row.attempt_count) == ("failed", "retries_exhausted", 2)


def test_engine_error_is_not_retried_and_exit_0_needs_a_result(settings: Settings, tmp_path: Path) -> None:
    assert _run_to_exit(settings, _job(settings), 1, tmp_path) == "failed"
    missing = _job(settings)
    assert _run_to_exit(settings, missing, 0, tmp_path) == "failed"
    with session_scope(settings.database_url) as session:
        assert session.get(Job, missing.id).error_code == "no_result"  # type: ignore[union-attr]
