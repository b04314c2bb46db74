"""Migration 0017: the reconciler's reads of start deadlines and of rows without resources go through partial indexes
(they read every waiting job before: most of a reconciler pass at 10,000 waiting), and on PostgreSQL the job_nodes
indexes by state hold only the rows their reads ask for; its downgrade restores 0016's indexes on both backends."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from core.db import alembic_config, get_engine, session_scope
from core.models import Job, JobNode, utcnow
from core.reconciler import _waiting
from core.scheduler import fill_resources
from core.settings import Settings
from core_support import fresh_postgres_database, isolated_settings, make_job

WAITING = 2000  # enough rows that a scan costs more than the partial index
CLONES = (
    "WITH copies AS (INSERT INTO jobs (id, team, kind, state, metadata, priority, queue, run_dir, max_restarts, "
    "attempt_count, created_at, updated_at, resources) SELECT gen_random_uuid(), team, kind, state, metadata, priority, "
    "queue, run_dir, max_restarts, attempt_count, created_at, updated_at, resources FROM jobs, generate_series(1, :n) "
    "WHERE id = :id RETURNING id) INSERT INTO job_specs (job_id, spec) SELECT copies.id, job_specs.spec FROM copies, "
    "job_specs WHERE job_specs.job_id = :id"
)


@pytest.fixture
def pg_database(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url) as url:
        yield url


def _plans(engine: sa.Engine, settings: Settings) -> list[str]:
    """The plans PostgreSQL chose for the deadline read (``_waiting``) and ``fill_resources``, as they ran."""
    statements: list[tuple[str, object]] = []

    def keep(_conn: object, _cursor: object, statement: str, params: object, *_: object) -> None:
        if "start_deadline_s" in statement or "SET resources" in statement:
            statements.append((statement, params))

    sa.event.listen(engine, "before_cursor_execute", keep)
    try:
        _waiting(settings, utcnow())
        with session_scope(settings.database_url) as session:
            fill_resources(session)
    finally:
        sa.event.remove(engine, "before_cursor_execute", keep)
    with engine.connect() as connection:
        return [
            "\n".join(row[0] for row in connection.exec_driver_sql(f"EXPLAIN {statement}", params))  # type: ignore[arg-type]
            for statement, params in statements
        ]


def _index_defs(engine: sa.Engine) -> dict[str, str]:
    query = "SELECT indexname, indexdef FROM pg_indexes WHERE tablename IN ('jobs', 'job_nodes', 'job_specs')"
    with engine.connect() as connection:
        return dict(connection.execute(sa.text(query)).tuples().all())


@pytest.mark.postgres
def test_the_reconciler_reads_through_partial_indexes_on_postgres(pg_database: str, tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, pg_database)
    engine = get_engine(pg_database)
    late, plain = make_job(settings, start_deadline_s=1), make_job(settings)
    with session_scope(settings.database_url) as session:  # the deadline passed; the read still finds it
        session.execute(sa.update(Job).where(Job.id == late).values(created_at=utcnow() - timedelta(seconds=60)))
    with engine.begin() as connection:  # copies of the plain job: a backlog without deadlines
        connection.execute(sa.text(CLONES), {"id": plain, "n": WAITING})
        connection.execute(sa.text("ANALYZE jobs"))
        connection.execute(sa.text("ANALYZE job_specs"))
    deadline_plan, fill_plan = _plans(engine, settings)
    assert "ix_job_specs_start_deadline" in deadline_plan, deadline_plan
    assert "ix_jobs_unfilled" in fill_plan, fill_plan
    assert [job_id for job_id, *_ in _waiting(settings, utcnow())[0]] == [late]
    defs = _index_defs(engine)
    assert "WHERE ((state)::text = 'assigned'::text)" in defs["ix_job_nodes_state"]
    assert "launching" in defs["ix_job_nodes_host_state"] and "exited" not in defs["ix_job_nodes_host_state"]
    command.downgrade(alembic_config(pg_database), "0016_hot_updates")
    defs = _index_defs(engine)
    assert "WHERE" not in defs["ix_job_nodes_state"] and "WHERE" not in defs["ix_job_nodes_host_state"]
    assert "ix_job_specs_start_deadline" not in defs and "ix_jobs_unfilled" not in defs
    get_engine(pg_database).dispose()


def test_0017_goes_down_and_up_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    config = alembic_config(url)
    command.upgrade(config, "head")
    command.downgrade(config, "0016_hot_updates")
    with get_engine(url).connect() as connection:
        names = set(connection.execute(sa.text("SELECT name FROM sqlite_master WHERE type = 'index'")).scalars())
    assert {"ix_job_nodes_state", "ix_job_nodes_host_state"} <= names
    assert not {"ix_job_specs_start_deadline", "ix_jobs_unfilled"} & names
    command.upgrade(config, "head")
    with session_scope(url) as session:  # the nodes' reads by state still answer on SQLite (its indexes whole)
        assert session.scalars(sa.select(JobNode.id).where(JobNode.state == "assigned")).all() == []
