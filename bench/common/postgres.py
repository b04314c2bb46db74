"""A benchmark's own PostgreSQL database (a helper of ``bench/``, not a benchmark): created for one run on the server
``--postgres`` names and dropped afterwards. Never the tests' shared ``test`` database: the test suite checks at each
PostgreSQL test's teardown that ``test`` holds no table, so a bench writing there while tests ran failed them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

# The server's maintenance database: only this run's CREATE/DROP DATABASE go through it. LLMJOBS_BENCH_POSTGRES_URL
# names one (trust auth, or a password in the URL); else the tests' server (LLMJOBS_TEST_POSTGRES_URL), its
# ``postgres`` database.
TESTS_SERVER = os.environ.get("LLMJOBS_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DEFAULT_SERVER = os.environ.get("LLMJOBS_BENCH_POSTGRES_URL") or sa.engine.make_url(TESTS_SERVER).set(
    database="postgres"
).render_as_string(hide_password=False)
PREFIX = "llmjobs_bench"


@contextmanager
def own_database(server_url: str, tag: str) -> Iterator[str]:
    """The URL of a new empty database ``llmjobs_bench_<tag>_<random>`` on ``server_url``'s server (a name of its own
    per run: two benches at once do not share one); dropped on exit WITH (FORCE), so a child process's connection
    left behind does not keep it. The caller disposes of its own pooled connections first."""
    name = f"{PREFIX}_{tag}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with admin.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield sa.engine.make_url(server_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()
