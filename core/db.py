"""Engine, sessions and migrations. The same code path serves SQLite (embedded) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, Select, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from core.settings import REPO_ROOT

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

ALEMBIC_INI = REPO_ROOT / "alembic.ini"
# PostgreSQL SQLSTATEs of a server that is going or not yet there (class 08 is every connection exception):
# admin_shutdown (a fast stop), crash_shutdown, cannot_connect_now (starting up), too_many_connections.
AWAY_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})
SQLITE_AWAY_CODES = frozenset({5, 6, 10, 14})  # SQLITE_BUSY, _LOCKED, _IOERR, _CANTOPEN (primary codes)
MIGRATION_LOCK_KEY = 0x6C6C6D6A6F6273  # "llmjobs": the PostgreSQL advisory lock every migrator takes


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while a worker writes; busy_timeout waits for the write lock instead of failing.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    return make_engine(url)


@lru_cache(maxsize=8)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def each_row(url: str, ids: Select[str], step: Callable[[str], object], what: str) -> int:
    """One pass of a leader's loop: ``step`` for every id the query selects now, each on its own (one that raises is
    logged with ``what`` and the others go on). Returns how many it looked at."""
    with session_scope(url) as session:
        found = list(session.scalars(ids))
    for row_id in found:
        try:
            step(row_id)
        except Exception:  # noqa: BLE001 - one broken row must not stop the others
            log.exception("%s %s failed", what, row_id)
    return len(found)


def upgrade_head(url: str, secret_keys: list[str] | None = None) -> None:
    """Apply every Alembic migration (``alembic upgrade head``) to the database at ``url``; ``secret_keys``
    (``app.secrets_box.keys``) seal stored secrets that a migration encrypts. Processes that start together take
    turns (``migration_lock``): the first migrates, the others then find the schema at head and change nothing."""
    from alembic import command

    config = alembic_config(url)
    config.attributes["secret_keys"] = secret_keys
    with migration_lock(url):
        command.upgrade(config, "head")


def alembic_config(url: str) -> Config:
    """Alembic's configuration for the database at ``url``: the repository's migrations, whatever the working
    directory (what ``upgrade_head``, the tests' downgrades and ``alembic`` commands run with)."""
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.attributes["database_url"] = url
    return config


@contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Held by one process at a time per database: a PostgreSQL session advisory lock, or a file lock beside a
    SQLite file. Either is released when its holder exits or dies, so a crashed migrator blocks no one."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            yield  # one connection, one process: nothing to race
            return
        from filelock import FileLock

        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{parsed.database}.migrate.lock"):
            yield
        return
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            connection.commit()  # the lock belongs to the session: no transaction stays open while we wait
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                connection.commit()
    finally:
        engine.dispose()


def is_database_away(err: BaseException) -> bool:
    """True when ``err`` says the database could not be reached or went away (down, restarting, unreachable,
    locked): the same statement may succeed later. False for everything the database answered and refused
    (integrity, programming, data errors, a deadlock or a cancelled query), which a retry would not change."""
    if not isinstance(err, (OperationalError, InterfaceError)):
        return False
    if err.connection_invalidated:  # the dialect recognised a disconnect
        return True
    sqlstate = getattr(err.orig, "sqlstate", None)  # psycopg: None when no server answered at all
    if sqlstate is not None:
        return sqlstate.startswith("08") or sqlstate in AWAY_SQLSTATES
    sqlite_code = getattr(err.orig, "sqlite_errorcode", None)
    if sqlite_code is not None:
        return sqlite_code & 0xFF in SQLITE_AWAY_CODES
    return True  # a driver error without a server's code: the connection itself failed


def ping(session: Session) -> None:
    """Raise unless the database answers (the readiness probe)."""
    session.execute(text("SELECT 1"))
