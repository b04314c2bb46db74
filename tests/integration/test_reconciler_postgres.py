"""The reconciler's waiting-job reads on PostgreSQL (counted per queue in the database, deadlines found by a text
match on the stored spec): a job past its start deadline fails, one without a deadline waits, a queue is woken
once."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from core.db import session_scope
from core.models import Job, utcnow
from core.reconciler import reconcile_once
from core_support import fresh_postgres_database, isolated_settings, make_job

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_database(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield url


def test_deadlines_and_wakes_on_postgres(tmp_path: Path, pg_database: str) -> None:
    settings = isolated_settings(tmp_path, database_url=pg_database, redispatch_after_s=60)
    late, patient, free = (
        make_job(settings, start_deadline_s=5),
        make_job(settings, start_deadline_s=3600),
        make_job(settings),
    )
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).values(created_at=utcnow() - timedelta(seconds=10)))
    assert reconcile_once(settings) == 1  # the one queue, woken once for the two jobs still waiting
    with session_scope(settings.database_url) as session:
        states = {job.id: (job.state, job.error_code, job.dispatched_at is not None) for job in session.query(Job)}
    assert states[late][:2] == ("failed", "start_deadline_exceeded")
    assert states[patient] == ("queued", None, True) and states[free] == ("queued", None, True)
    assert reconcile_once(settings) == 0  # woken just now
