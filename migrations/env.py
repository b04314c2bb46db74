"""Alembic environment: the URL comes from the caller (core.db.upgrade_head) or from core.settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from core.db import make_engine
from core.models import Base
from core.settings import Settings

config = context.config
url = config.attributes.get("database_url") or Settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            _sqlite_foreign_keys(connection, on=False)
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        if sqlite:
            _sqlite_foreign_keys(connection, on=True)
    engine.dispose()


def _sqlite_foreign_keys(connection: Connection, on: bool) -> None:
    """SQLite's batch migrations rebuild a table (copy, DROP, rename); with foreign keys on, the DROP deletes every
    row that references the table (ON DELETE CASCADE: a job's events, metrics, served names). Off while migrating
    (SQLite ignores the pragma inside a transaction, hence its own commit); on again only if every reference holds."""
    if on:
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            raise RuntimeError(f"migration left rows whose references do not hold: {broken[:5]}")
    connection.exec_driver_sql(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
    connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
