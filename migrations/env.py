"""Alembic environment: the URL comes from the caller (core.db.upgrade_head) or from core.settings."""

from __future__ import annotations

from alembic import context

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
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
