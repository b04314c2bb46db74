"""Database behaviour on SQLite: migrations match the models; transitions are compare-and-set; claims are exclusive."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select

from core.db import alembic_config, each_row, get_engine, session_scope
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


def test_each_row_steps_through_every_selected_row_past_one_that_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = isolated_settings(tmp_path)
    ids = sorted(make_job(settings) for _ in range(3))
    seen: list[str] = []

    def step(job_id: str) -> None:
        seen.append(job_id)
        if job_id == ids[1]:
            raise RuntimeError("broken")

    assert each_row(settings.database_url, select(Job.id).order_by(Job.id), step, "checking job") == 3
    assert seen == ids  # the one after the broken row still ran
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [f"checking job {ids[1]} failed"]
    assert each_row(settings.database_url, select(Job.id).where(Job.id == "none"), step, "checking job") == 0


def test_only_one_of_many_workers_claims_a_job(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    job_id = make_job(settings)
    wins = race_claims(settings, job_id, workers=6)
    assert len(wins) == 1
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.state == "starting" and job.attempt_count == 1 and job.host == wins[0]


def test_job_resources_are_filled_for_old_rows_and_read_either_way(tmp_path: Path) -> None:
    """Migration 0007 copies each stored spec's resources into jobs.resources; a row without it (inserted by an
    older replica during a rolling upgrade) is filled from its spec by the reconciler's ``fill_resources``, after
    which the scheduler reads it (its read goes by ``ix_jobs_waiting_turn``, keyed on the column)."""
    import json

    from alembic import command
    from sqlalchemy import text, update

    from core.scheduler import fill_resources, waiting_jobs

    url = f"sqlite:///{tmp_path / 'old.db'}"
    config = alembic_config(url)
    command.upgrade(config, "0006")
    spec = {"kind": "train", "resources": {"device_type": "cuda", "nnodes": 2, "nproc_per_node": 8}}
    with get_engine(url).begin() as connection:
        connection.execute(
            text(
                "INSERT INTO jobs (id, team, kind, state, spec, metadata, priority, queue, run_dir, max_restarts, "
                "attempt_count, created_at, updated_at) VALUES ('old', 't', 'train', 'queued', :spec, '{}', 0, 'q', "
                "'r', 0, 0, '2026-01-01 00:00:00', '2026-01-01 00:00:00')"
            ),
            {"spec": json.dumps(spec)},
        )
    command.upgrade(config, "head")
    with session_scope(url) as session:
        stored = session.get(Job, "old")
        assert stored is not None and json.loads(stored.resources or "") == spec["resources"]
        session.execute(update(Job).values(resources=None))  # as an older replica leaves it
        assert waiting_jobs(session, 200) == []
        assert fill_resources(session) == 1
        (waiting,) = waiting_jobs(session, 200)
        assert json.loads(waiting.resources) == spec["resources"]


def test_job_specs_move_to_their_table_and_back(tmp_path: Path) -> None:
    """Migration 0014 moves each spec out of the job row (rewritten on every update) into ``job_specs``, keeps the
    waiting-turn index's order on SQLite's table rebuild, and its downgrade moves the specs back."""
    import json

    from alembic import command
    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'specs.db'}"
    config = alembic_config(url)
    command.upgrade(config, "0013")
    spec = {"kind": "train", "train_iters": 4, "resources": {"device_type": "cpu", "nnodes": 1, "nproc_per_node": 1}}
    insert = (
        "INSERT INTO jobs (id, team, kind, state, spec, metadata, priority, queue, run_dir, max_restarts, "
        "attempt_count, created_at, updated_at) VALUES ('a', 't', 'train', 'queued', :spec, '{}', 0, 'q', 'r', 0, 0, "
        "'2026-01-01 00:00:00', '2026-01-01 00:00:00')"
    )
    event = (  # a row referencing the job (ON DELETE CASCADE): SQLite's rebuild of jobs must not delete it
        "INSERT INTO events (job_id, time, type, level, message, data) VALUES ('a', '2026-01-01 00:00:00', 'queued', "
        "'info', 'kept', '{}')"
    )
    with get_engine(url).begin() as connection:
        connection.execute(text(insert), {"spec": json.dumps(spec)})
        connection.execute(text(event))
    command.upgrade(config, "0014_job_specs")
    with session_scope(url) as session:
        job = session.get(Job, "a")
        assert job is not None and job.spec == spec
        assert session.scalar(select(Job.spec["train_iters"].as_integer())) == 4
        index = session.scalar(text("SELECT sql FROM sqlite_master WHERE name = 'ix_jobs_waiting_turn'"))
        assert "priority DESC" in index
        assert "spec" not in [c[1] for c in session.execute(text("PRAGMA table_info(jobs)"))]
        assert session.scalar(text("SELECT message FROM events WHERE job_id = 'a'")) == "kept"
    command.downgrade(config, "0013")
    with get_engine(url).begin() as connection:
        assert json.loads(connection.scalar(text("SELECT spec FROM jobs WHERE id = 'a'"))) == spec
        assert connection.scalar(text("SELECT message FROM events WHERE job_id = 'a'")) == "kept"
        assert connection.scalar(text("SELECT count(*) FROM sqlite_master WHERE name = 'job_specs'")) == 0
