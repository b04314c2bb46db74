"""More faults with a real worker: a rank killed mid-training fails the attempt (torchrun exits 1, retryable by
policy) and the job resumes from its checkpoint; 2-slot jobs share a 4-slot host two at a time, and run deadlines
stop jobs and free their slots."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from core.db import session_scope
from core.models import Event, JobNode, Lease
from core_support import isolated_settings, team_dir
from sched_support import (
    job_processes,
    job_row,
    log_text,
    reconciler,
    resumable_spec,
    running_worker,
    submit,
    tiny_data,
    train_spec,
    wait_checkpointed,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.slow


def _rank(job_id: str, local_rank: str) -> psutil.Process:
    for pid in job_processes(job_id):
        proc = psutil.Process(pid)
        if proc.environ().get("LOCAL_RANK") == local_rank:
            return proc
    raise AssertionError(f"no rank {local_rank} of {job_id}")


def test_dead_rank_requeues_and_resumes(tmp_path: Path) -> None:
    # no retry backoff (tests/unit/core/test_retry_backoff.py): the default 10 s was waited out before attempt 2
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3, retry_backoff_s=0)
    spec = resumable_spec(tiny_data(settings), team_dir(settings, "t") / "ckpt", iters=100, max_restarts=1)
    with running_worker(settings, "h1", 2, tmp_path / "h1.log"), reconciler(settings):
        job_id = submit(settings, spec)
        wait_checkpointed(settings, job_id, 180)
        _rank(job_id, "1").kill()
        row = wait_terminal(settings, job_id, 240)
    assert row.state == "succeeded" and row.attempt_count == 2, log_text(settings, job_id)
    assert (row.result or {})["summary"]["start_iteration"] >= 10
    with session_scope(settings.database_url) as session:
        retry = session.scalar(select(Event.message).where(Event.job_id == job_id, Event.message.like("retrying%")))
        first = session.scalars(select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == 1)).one()
    assert retry is not None and "(1 of 2 attempts used)" in retry
    assert first.exit_code == 1  # torchrun's exit when a rank dies: retryable by the default policy


def test_two_of_three_run_at_once_and_deadlines_free_their_slots(tmp_path: Path) -> None:
    """3 jobs of 2 CPU slots on a 4-slot host: 2 run at once, the third waits with a reason; each run deadline stops
    its job, and the devices it frees (once its processes are gone) start the third."""
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3, cancel_grace_s=2)
    spec = train_spec(
        tiny_data(settings), train_iters=100000, run_deadline_s=6, max_restarts=3, resources={"nproc_per_node": 2}
    )
    with running_worker(settings, "h1", 4, tmp_path / "h1.log"), reconciler(settings):
        a, b, c = (submit(settings, spec) for _ in range(3))
        wait_for(
            settings,
            b,
            lambda r: r.state == "running" and job_row(settings, a).state == "running",
            120,
            "running together with the first",
        )
        waiting = job_row(settings, c)
        rows = [wait_terminal(settings, j, 180) for j in (a, b, c)]
    assert waiting.state == "queued"
    assert waiting.pending_reason == "waiting for 2 free cpu devices on one host; host h1 has 0 free"
    for row in rows:
        assert (row.state, row.error_code, row.attempt_count) == ("failed", "run_deadline_exceeded", 1), log_text(
            settings, row.id
        )
        assert job_processes(row.id) == []
    assert rows[2].started_at is not None and rows[2].started_at >= min(r.finished_at for r in rows[:2])  # type: ignore[type-var]
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Lease)).all() == []
