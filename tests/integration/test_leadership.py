"""Leadership on PostgreSQL: one holder of the advisory lock at a time; a dead leader's lock passes on at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from core.leadership import Leadership
from core_support import fresh_postgres_database

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url) as url:
        yield url


def leader_backends(url: str) -> list[int]:
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        pids = list(
            connection.scalars(
                sa.text(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'llmjobs-leader:%' AND datname = current_database()"
                )
            )
        )
    engine.dispose()
    return pids


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_one_leader_and_takeover_when_its_session_dies(pg_url: str) -> None:
    first, second = Leadership(pg_url), Leadership(pg_url)
    assert first.is_leader() and not second.is_leader() and first.is_leader()
    assert first.led_for() > 0 and second.led_for() == 0  # how long it has led: the reconciler's host grace
    [backend] = leader_backends(pg_url)
    admin = sa.create_engine(pg_url)
    with admin.connect() as connection:  # what the server does when the leader process is SIGKILLed
        connection.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": backend})
    admin.dispose()
    # pg_terminate_backend only signals the backend; the lock is freed when it has exited, a moment later
    assert eventually(second.is_leader)
    assert not first.is_leader()  # it notices its session is gone and does not take the lock back
    assert first.led_for() == 0 and second.led_for() < 10  # the new leader's count starts at its takeover
    second.release()
    assert first.is_leader()
    first.release()


def test_sqlite_is_always_its_own_leader(tmp_path: Path) -> None:
    leader = Leadership(f"sqlite:///{tmp_path / 'x.db'}")
    assert leader.is_leader() and leader.led_for() == float("inf")
