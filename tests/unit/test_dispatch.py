"""The reconciler: lost messages are re-sent, start deadlines hold. (Pending reasons: core.scheduler's tests.)"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import update

from core.db import session_scope
from core.models import Job, utcnow
from core.reconciler import reconcile_once
from core.settings import Settings
from core_support import isolated_settings, make_job


def _broker_messages(settings: Settings) -> int:
    engine = sa.create_engine(settings.broker_url.removeprefix("sqla+"))
    with engine.connect() as connection:
        count = connection.execute(sa.text("SELECT count(*) FROM kombu_message")).scalar_one()
    engine.dispose()
    return count


def _job(settings: Settings, job_id: str) -> Job:
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_lost_message_is_sent_again(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, redispatch_after_s=60)
    job_id = make_job(settings)  # committed, but its message never went out (say the broker was down)
    assert reconcile_once(settings) == 1
    assert _broker_messages(settings) == 1
    assert _job(settings, job_id).dispatched_at is not None
    assert reconcile_once(settings) == 0  # recently sent: left alone
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).values(dispatched_at=utcnow() - timedelta(seconds=120)))
    assert reconcile_once(settings) == 1 and _broker_messages(settings) == 2


def test_start_deadline_fails_a_waiting_job(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    job_id = make_job(settings, start_deadline_s=5)
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).values(created_at=utcnow() - timedelta(seconds=10)))
    reconcile_once(settings)
    job = _job(settings, job_id)
    assert (job.state, job.error_code) == ("failed", "start_deadline_exceeded")
    assert "start_deadline_s=5" in (job.error_message or "")
