"""Helpers for tests of the service: isolated settings, a migrated database, tokens, an HTTP client."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from core import secrets_box
from core.auth import create_token
from core.db import session_scope, upgrade_head
from core.settings import Settings


def isolated_settings(var_dir: Path, database_url: str | None = None, **overrides: Any) -> Settings:
    """Settings whose files all live under ``var_dir`` (SQLite unless ``database_url`` is given), migrated."""
    # Everything that locates state is passed explicitly, so LLMJOBS_* variables of the caller's shell never leak in.
    where: dict[str, Any] = {"broker_url": "", "redis_url": None, "data_roots": [], "runs_dir": None}
    settings = Settings(var_dir=var_dir, database_url=database_url or "", **{**where, **overrides})
    settings.ensure_dirs()
    if not database_url:
        _copy_migrated_sqlite(settings.var_dir / "llmjobs.db")
    elif database_url not in _AT_HEAD:  # one fresh_postgres_database cloned at head needs nothing
        upgrade_head(settings.database_url, secrets_box.keys(settings))
    return settings


_MIGRATED: list[Path] = []  # this process's empty SQLite database at head, made once


def _copy_migrated_sqlite(target: Path) -> None:
    """A SQLite database at the migrations' head, copied from one this process migrated once: running the 17
    migrations took 0.3-1 s per test, and ~800 tests start from an empty database (the migrations themselves are
    tested from empty by tests/unit/core/test_db.py and tests/integration/test_migration_race.py). A plain file copy
    (2 ms; SQLite's backup API took 60 ms, its journal and syncs): the migration's engine is disposed, so no
    connection is open and the file holds everything (no -wal beside it). An empty database seals no secret, so the
    keys do not matter to the copy."""
    if not _MIGRATED:
        source = Path(tempfile.mkdtemp(prefix="llmjobs-migrated-")) / "llmjobs.db"
        upgrade_head(f"sqlite:///{source}", [])
        assert not Path(f"{source}-wal").exists(), "a connection to the migrated copy is still open"
        _MIGRATED.append(source)
    shutil.copyfile(_MIGRATED[0], target)


def make_token(settings: Settings, team: str, admin: bool = False) -> str:
    with session_scope(settings.database_url) as session:
        return create_token(session, team=team, admin=admin)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_job(settings: Settings, team: str = "t", **fields: Any) -> str:
    """A queued preprocess job (paths are not checked); returns its id."""
    from core.jobs import create_job
    from engine.contract.spec import parse_spec

    raw = {"kind": "preprocess", "input": "a", "tokenizer_name_or_path": "t", "output_prefix": "o", **fields}
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team=team, spec=parse_spec(raw), raw=raw)
        return job.id


def set_job_spec(session: Any, job_id: str, spec: dict[str, Any], **fields: Any) -> None:
    """Turn a stored job into another kind for a test: its row's ``fields`` and its spec (``job_specs``, migration 0014:
    the spec is not a column of ``jobs``, so ``update(Job).values(spec=...)`` cannot set it)."""
    from sqlalchemy import update

    from core.models import Job, JobSpec

    session.execute(update(Job).where(Job.id == job_id).values(kind=spec["kind"], **fields))
    session.merge(JobSpec(job_id=job_id, spec=spec))


@contextmanager
def fresh_postgres_database(server_url: str, migrated: bool = False) -> Iterator[str]:
    """A new database on the server of ``server_url`` for one test session; dropped afterwards. Empty, or with
    ``migrated`` at the migrations' head: cloned from a template this process migrated once (the clone costs what an
    empty database does, 2-3 s at load 23; migrating one took 5.6 s more), and ``isolated_settings`` then skips its
    own upgrade of that URL. Tests of the migrations themselves take an empty one."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    from core.db import get_engine

    name = f"llmjobs_test_{uuid.uuid4().hex[:10]}"
    template = f' TEMPLATE "{_postgres_template(server_url)}"' if migrated else ""
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"{template}'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    if migrated:
        _AT_HEAD[url] = _TEMPLATES[server_url]
    try:
        yield url
    finally:
        _AT_HEAD.pop(url, None)
        get_engine(url).dispose()
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


_AT_HEAD: dict[str, str] = {}  # URL of a database cloned at head -> its template (isolated_settings skips these)
_TEMPLATES: dict[str, str] = {}  # server URL -> this process's migrated template database on it
_SEEDED: dict[str, dict[str, list[dict[str, Any]]]] = {}  # template -> the rows its migrations wrote, by table


def _postgres_template(server_url: str) -> str:
    """The name of an empty database at head on ``server_url``, made once per process and dropped at its exit; no
    connection to it stays open (PostgreSQL copies a template only while nobody is connected to it)."""
    if server_url in _TEMPLATES:
        return _TEMPLATES[server_url]
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = f"llmjobs_test_template_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    upgrade_head(url, [])
    _SEEDED[name] = _seeded_rows(url)

    def drop() -> None:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    atexit.register(drop)
    _TEMPLATES[server_url] = name
    return name


def _seeded_rows(url: str) -> dict[str, list[dict[str, Any]]]:
    """The rows of every table of ``url`` but alembic_version (the scheduler's lock rows at head); disconnects."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as connection:
            tables = connection.execute(sa.text(_PUBLIC_TABLES)).scalars().all()
            return {
                t: [dict(r) for r in connection.execute(sa.text(f'SELECT * FROM "{t}"')).mappings()] for t in tables
            }
    finally:
        engine.dispose()


_PUBLIC_TABLES = "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename != 'alembic_version'"


def reset_postgres_database(url: str) -> None:
    """``url`` (from ``fresh_postgres_database(migrated=True)``) back to what the clone held: every table emptied
    (foreign keys unchecked meanwhile), every sequence restarted, the migrations' rows written again. ~20 ms, where a
    new clone took 1.5 s and its drop 4 s (load 21): for modules whose every test wants a database of its own."""
    import sqlalchemy as sa

    from core.db import get_engine

    seeded = _SEEDED[_AT_HEAD[url]]
    with get_engine(url).begin() as connection:
        connection.execute(sa.text("SET LOCAL session_replication_role = replica"))  # no FK order to follow
        for table in connection.execute(sa.text(_PUBLIC_TABLES)).scalars().all():
            connection.execute(sa.text(f'DELETE FROM "{table}"'))
        for table, rows in seeded.items():
            if rows:
                names = list(rows[0])
                columns, values = ", ".join(f'"{n}"' for n in names), ", ".join(f":{n}" for n in names)
                connection.execute(sa.text(f'INSERT INTO "{table}" ({columns}) VALUES ({values})'), rows)
        connection.execute(
            sa.text("SELECT setval(oid, seqstart, false) FROM pg_class JOIN pg_sequence ON seqrelid = oid")
        )


def claim(settings: Settings, job_id: str, host: str) -> bool:
    """queued -> starting with one more attempt, the compare-and-set a worker does to take a job."""
    from core.jobs import transition
    from core.models import Job
    from core.states import JobState

    with session_scope(settings.database_url) as session:
        return transition(session, job_id, JobState.starting, host=host, attempt_count=Job.attempt_count + 1)


def race_claims(settings: Settings, job_id: str, workers: int) -> list[str]:
    """``workers`` threads claim the job at the same instant; returns the hosts that won."""
    import threading

    wins: list[str] = []
    barrier = threading.Barrier(workers)

    def worker(name: str) -> None:
        barrier.wait()
        if claim(settings, job_id, name):
            wins.append(name)

    threads = [threading.Thread(target=worker, args=(f"h{i}",)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins


def team_dir(settings: Settings, team: str) -> Path:
    """``team``'s data area in the first data root (created): relative spec paths of its jobs start here."""
    from core.paths import ensure_team_areas

    return ensure_team_areas(settings, team).write[0]


def require_tool(found: object, what: str) -> None:
    """A real component a test needs (the MLflow server, Slurm): skip when absent, fail under LLMJOBS_REQUIRE_SERVICES=1
    (.ci/run installs and starts them with the repository's scripts), as conftest's require_service does."""
    if found:
        return
    if os.environ.get("LLMJOBS_REQUIRE_SERVICES") == "1":
        pytest.fail(what + " (LLMJOBS_REQUIRE_SERVICES=1)")
    pytest.skip(what)
