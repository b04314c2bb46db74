"""Six processes that start together on one database (API replicas and workers under `docker compose up`): each runs
the start-up function (``cli.env.prepare``: migrate to head), none may die, and the schema ends at head. Every round
gets a fresh database; odd rounds start from an old one (revision 0003, the step the probe saw collide)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from core.db import ALEMBIC_INI, REPO_ROOT, migration_lock
from core_support import fresh_postgres_database

PROCESSES = 6
ROUNDS = 20
pytestmark = pytest.mark.slow


def _start(url: str, var_dir: str, go: Event) -> None:
    """One process's start-up: wait for the common start, then migrate as `llmjobs api` / `worker` do."""
    os.environ["LLMJOBS_DATABASE_URL"] = url
    os.environ["LLMJOBS_VAR_DIR"] = var_dir
    from cli.env import load_settings, prepare

    go.wait()
    prepare(load_settings())  # an exception prints its traceback and exits the child with 1


def _race(url: str, var_dir: Path) -> list[int | None]:
    context = multiprocessing.get_context("fork")  # imports done once, so six start-ups overlap for real
    go = context.Event()
    children = [context.Process(target=_start, args=(url, str(var_dir), go)) for _ in range(PROCESSES)]
    for child in children:
        child.start()
    go.set()
    for child in children:
        child.join(120)
    return [child.exitcode for child in children]


def _upgrade_to(url: str, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.attributes["database_url"] = url
    with migration_lock(url):
        command.upgrade(config, revision)


def _script_head() -> str:
    """The newest revision in migrations/ (what ``upgrade head`` reaches)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


def _head(url: str) -> Any:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    finally:
        engine.dispose()


def _rounds(database: Callable[[int], AbstractContextManager[str]], var_dir: Path) -> list[list[int | None]]:
    results = []
    for number in range(ROUNDS):
        with database(number) as url:
            if number % 2:
                _upgrade_to(url, "0003")
            codes = _race(url, var_dir)
            results.append(codes)
            assert codes == [0] * PROCESSES, f"round {number}: exit codes {codes}"
            assert _head(url) == [_script_head()]
    return results


def test_sqlite_start_race(tmp_path: Path) -> None:
    results = _rounds(lambda number: nullcontext(f"sqlite:///{tmp_path}/round{number}/llmjobs.db"), tmp_path)
    print(f"sqlite: {len(results)} rounds x {PROCESSES} processes, all exited 0")


def test_postgres_start_race(postgres_url: str, tmp_path: Path) -> None:
    results = _rounds(lambda number: fresh_postgres_database(postgres_url), tmp_path)
    print(f"postgresql: {len(results)} rounds x {PROCESSES} processes, all exited 0")
