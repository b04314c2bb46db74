"""Six processes that start together on one database (API replicas and workers under `docker compose up`): each runs
the start-up function (``cli.env.prepare``: migrate to head), none may die, and the schema ends at head. Every round
gets a fresh database; odd rounds start from an old one (revision 0003, the step the probe saw collide)."""

from __future__ import annotations

import importlib
import multiprocessing
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from core.db import ALEMBIC_INI, REPO_ROOT, alembic_config, migration_lock
from core_support import fresh_postgres_database

PROCESSES = 6
# Without migration_lock every round fails (five of the six die; 8 of 8 rounds on SQLite, 8 of 8 on PostgreSQL, once
# the start-ups race for real): six rounds, three from each starting point, catch it; twenty took 25-56 s a backend.
ROUNDS = 6
pytestmark = pytest.mark.slow


# What a start-up imports (cli.env, Alembic's runtime, the models migrations/env.py loads), imported here once so
# that forked children inherit it: each child importing it again took ~1.2 s of CPU, six of them ~2 s a round on
# 2 cores, and staggered their start-ups by that import's jitter instead of racing them.
START_UP_MODULES = ("cli.env", "alembic.command", "alembic.runtime.environment", "alembic.op", "core.models")


def _start(url: str, var_dir: str, go: Barrier) -> None:
    """One process's start-up: wait until all six are ready, then migrate as `llmjobs api` / `worker` do."""
    os.environ["LLMJOBS_DATABASE_URL"] = url
    os.environ["LLMJOBS_VAR_DIR"] = var_dir
    from cli.env import load_settings, prepare

    settings = load_settings()
    go.wait(60)
    prepare(settings)  # an exception prints its traceback and exits the child with 1


def _race(url: str, var_dir: Path) -> list[int | None]:
    for module in START_UP_MODULES:
        importlib.import_module(module)
    context = multiprocessing.get_context("fork")  # imports done once, so six start-ups overlap for real
    go = context.Barrier(PROCESSES)
    children = [context.Process(target=_start, args=(url, str(var_dir), go)) for _ in range(PROCESSES)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    return [child.exitcode for child in children]


def _upgrade_to(url: str, revision: str) -> None:
    from alembic import command

    config = alembic_config(url)
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
