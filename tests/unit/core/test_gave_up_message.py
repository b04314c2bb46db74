"""A job whose retries ran out (an eval whose deployment disappeared, say) ends with a message that says it gave up
and after how many attempts, never one still ending "retrying"."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import insert, update

from core.db import session_scope
from core.models import Job, JobNode, utcnow
from core.recovery import end_attempt
from core_support import isolated_settings, make_job


def test_the_last_retry_says_it_gave_up(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    job_id = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(state="running", attempt_count=1, max_restarts=0))
        node = {"job_id": job_id, "attempt": 1, "node_rank": 0, "host": "h", "devices": [0]}
        session.execute(insert(JobNode), [{**node, "master_addr": "h", "master_port": 1, "started_at": utcnow()}])
        session.commit()
    gone = "deployment 'demo-chat' is not ready (gone); retrying"
    assert end_attempt(settings, job_id, 1, retryable=True, error_code="launch_failed", message=gone) == "failed"
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.error_code == "retries_exhausted"
        assert job.error_message == "gave up after 1 of 1 attempts: deployment 'demo-chat' is not ready (gone)"
