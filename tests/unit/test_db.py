"""Database behaviour on SQLite: migrations match the models; transitions are compare-and-set; claims are exclusive."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from core.db import get_engine, session_scope
from core.jobs import transition
from core.models import Base, Event, Job
from core.states import JobState
from core_support import isolated_settings, make_job, race_claims


def test_migrations_match_the_models(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    with get_engine(settings.database_url).connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == [], f"models changed without a migration: {diff}"


def test_terminal_state_is_final(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    job_id = make_job(settings)
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.cancelled)
        for target in JobState:
            assert not transition(session, job_id, target)
        job = session.get(Job, job_id)
        assert job is not None and job.state == "cancelled" and job.finished_at is not None
        states = [e.data["state"] for e in session.query(Event).filter_by(job_id=job_id).order_by(Event.id)]
    assert states == ["queued", "cancelled"]


def test_only_one_of_many_workers_claims_a_job(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    job_id = make_job(settings)
    wins = race_claims(settings, job_id, workers=6)
    assert len(wins) == 1
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.state == "starting" and job.attempt_count == 1 and job.host == wins[0]
