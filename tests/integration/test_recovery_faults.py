"""More faults with a real worker: a rank killed mid-training fails the attempt (torchrun exits 1, retryable by
policy) and the job resumes from its checkpoint; a run deadline stops the job and frees its devices."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from app.db import session_scope
from app.models import Event, JobNode, Lease
from app.testing import isolated_settings
from sched_support import (job_processes, log_text, reconciler, start_worker, stop_worker, submit, train_spec, wait_for,
                           wait_terminal, write_tiny_data)

pytestmark = pytest.mark.slow


def _rank(job_id: str, local_rank: str) -> psutil.Process:
    for pid in job_processes(job_id):
        proc = psutil.Process(pid)
        if proc.environ().get("LOCAL_RANK") == local_rank:
            return proc
    raise AssertionError(f"no rank {local_rank} of {job_id}")


def test_dead_rank_requeues_and_resumes(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3)
    data = write_tiny_data(settings.data_roots[0] / "tiny")
    spec = train_spec(data, train_iters=100, save_interval=10, save=str(settings.data_roots[0] / "ckpt"),
                      max_restarts=1, resources={"nproc_per_node": 2})
    worker = start_worker(settings, "h1", 2, tmp_path / "h1.log")
    try:
        with reconciler(settings):
            job_id = submit(settings, spec)

            def checkpointed(_: object) -> bool:
                with session_scope(settings.database_url) as session:
                    return bool(session.scalar(select(func.count()).select_from(Event).where(
                        Event.job_id == job_id, Event.type == "checkpoint")))

            wait_for(settings, job_id, checkpointed, 180, "checkpointed")
            _rank(job_id, "1").kill()
            row = wait_terminal(settings, job_id, 240)
    finally:
        stop_worker(worker)
    assert row.state == "succeeded" and row.attempt_count == 2, log_text(settings, job_id)
    assert (row.result or {})["summary"]["start_iteration"] >= 10
    with session_scope(settings.database_url) as session:
        retry = session.scalar(select(Event.message).where(Event.job_id == job_id, Event.message.like("retrying%")))
        first = session.scalars(select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == 1)).one()
    assert retry is not None and "(1 of 2 attempts used)" in retry
    assert first.exit_code == 1  # torchrun's exit when a rank dies: retryable by the default policy


def test_run_deadline_stops_the_job_and_frees_devices(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3, cancel_grace_s=2)
    data = write_tiny_data(settings.data_roots[0] / "tiny")
    worker = start_worker(settings, "h1", 1, tmp_path / "h1.log")
    try:
        with reconciler(settings):
            job_id = submit(settings, train_spec(data, train_iters=100000, run_deadline_s=8, max_restarts=3))
            started = time.monotonic()
            row = wait_terminal(settings, job_id, 120)
            elapsed = time.monotonic() - started
    finally:
        stop_worker(worker)
    assert (row.state, row.error_code, row.attempt_count) == ("failed", "run_deadline_exceeded", 1), log_text(settings, job_id)
    assert elapsed < 60
    assert job_processes(job_id) == []
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Lease)).all() == []
