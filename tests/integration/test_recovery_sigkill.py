"""Faults with real workers: a worker SIGKILLed mid-training leaves no process behind; its host stops heart-beating,
so the job is re-queued, and once the host is back (its worker checks the devices are free) the job resumes from
its checkpoint and succeeds. A redelivered broker message never starts a second run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from core.db import session_scope
from core.messaging import send_run_node
from core.models import Attempt, Event, JobNode, Lease
from core_support import isolated_settings, team_dir
from sched_support import (
    describe_processes,
    job_processes,
    log_text,
    reconciler,
    resumable_spec,
    running_worker,
    start_worker,
    stop_worker,
    submit,
    tiny_data,
    train_spec,
    wait_checkpointed,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.slow


def test_sigkilled_worker_leaves_no_orphan_and_job_resumes(tmp_path: Path) -> None:
    # no retry backoff (tests/unit/core/test_retry_backoff.py): its default 10 s was waited out after the host came back
    settings = isolated_settings(
        tmp_path, heartbeat_interval_s=1, host_stale_after_s=6, ingest_interval_s=0.3, retry_backoff_s=0
    )
    spec = resumable_spec(tiny_data(settings), team_dir(settings, "t") / "ckpt", iters=120, max_restarts=2)
    worker = start_worker(settings, "h1", 2, tmp_path / "h1.log")
    try:
        with reconciler(settings):
            job_id = submit(settings, spec)
            wait_checkpointed(settings, job_id, 180)
            engine = job_processes(job_id)
            assert len(engine) >= 3, engine  # torchrun and its two ranks
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            deadline = time.monotonic() + 30
            while job_processes(job_id) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = job_processes(job_id)
            assert left == [], "the engine outlived its SIGKILLed worker:\n" + describe_processes(left)
            waiting = wait_for(
                settings,
                job_id,
                lambda r: r.state == "retrying" and r.pending_reason,
                60,
                "re-queued after its host stopped heart-beating",
            )
            worker = start_worker(settings, "h1", 2, tmp_path / "h1.log")  # the host comes back
            row = wait_terminal(settings, job_id, 240)
    finally:
        stop_worker(worker)
    assert row.state == "succeeded", log_text(settings, job_id)
    assert row.attempt_count == 2
    assert (waiting.pending_reason or "").startswith("no live worker serves cpu devices")
    summary = (row.result or {})["summary"]
    assert summary["resumed_from"] and summary["start_iteration"] >= 10 and summary["iterations"] == 120
    with session_scope(settings.database_url) as session:
        lost = session.scalars(select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == 1)).one()
        assert lost.state == "lost" and lost.reason == "host h1 stopped heart-beating" and lost.released_at is not None
        assert session.scalars(select(Lease)).all() == []
    assert job_processes(job_id) == []


def _skipped(log: Path) -> int:
    """How many "run node" messages the worker answered 'skipped' (celery's task-result lines)."""
    return sum("'skipped'" in line for line in log.read_text().splitlines())


def test_redelivered_message_does_not_start_a_second_run(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3)
    data = tiny_data(settings)
    with running_worker(settings, "h1", 2, tmp_path / "h1.log"), reconciler(settings):
        job_id = submit(settings, train_spec(data, train_iters=40))
        wait_for(settings, job_id, lambda r: r.state == "running", 120, "running")
        for _ in range(2):  # the broker hands the same "run node" message out again
            send_run_node(settings, job_id, 1, 0, "h1")
        row = wait_terminal(settings, job_id, 180)
        send_run_node(settings, job_id, 1, 0, "h1")  # and after the end
        deadline = time.monotonic() + 30  # each of the three handled (skipped) before the worker stops
        while _skipped(tmp_path / "h1.log") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert row.state == "succeeded" and row.attempt_count == 1, log_text(settings, job_id)
    with session_scope(settings.database_url) as session:
        assert session.scalar(select(func.count()).select_from(Attempt).where(Attempt.job_id == job_id)) == 1
        started = session.scalar(
            select(func.count()).select_from(Event).where(Event.job_id == job_id, Event.type == "started")
        )
        assert started == 1
    assert _skipped(tmp_path / "h1.log") == 3
