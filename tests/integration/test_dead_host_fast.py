"""A dead host in seconds, not host_stale_after_s: a worker SIGKILLed mid-job loses its presence (its PostgreSQL
session and the advisory lock with it) and the leader's host pass ends the job's attempt within 10 s with the default
settings; a worker stopped cleanly says goodbye (its host down, its attempt retried without backoff); a live
worker's presence is read as such."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from core.db import session_scope
from core.host_presence import PresenceLock, absent_hosts, presence_kind
from core.models import Host, JobNode
from core.reconciler import reconcile_once, service_watch, watch_hosts
from core.settings import Settings
from core_support import fresh_postgres_database, isolated_settings
from sched_support import job_processes, log_text, start_worker, stop_worker, submit, tiny_data, train_spec, wait_for
from worker.hosts import register_host

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield url


@contextlib.contextmanager
def leader_loops(settings: Settings) -> Iterator[None]:
    """The leader's host pass (every presence_interval_s) and its reconciler (hosts left to the host pass), as
    ``core.background_loops`` runs them, in threads."""
    stop = threading.Event()
    watch = service_watch(settings)

    def every(interval: float, step: object) -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):  # a busy database: next round
                step()  # type: ignore[operator]

    threads = [
        threading.Thread(target=every, args=(settings.presence_interval_s, lambda: watch_hosts(settings, watch))),
        threading.Thread(target=every, args=(0.5, lambda: reconcile_once(settings, judge_hosts=False))),
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def test_presence_of_a_live_and_a_gone_worker(tmp_path: Path, pg_url: str) -> None:
    settings = isolated_settings(tmp_path, pg_url)
    lock = PresenceLock(settings.database_url, "h1")
    assert lock.hold()
    assert not PresenceLock(settings.database_url, "h1").hold()  # a second worker of h1 waits for the first
    register_host(settings, name="h1", device_type="cpu", devices=1, queues=["q"], presence=presence_kind(True))
    register_host(settings, name="old", device_type="cpu", devices=1, queues=["q"])  # no presence recorded
    with session_scope(settings.database_url) as session:
        hosts = list(session.scalars(select(Host)))
        assert absent_hosts(session, hosts) == set()
    lock.release()
    with session_scope(settings.database_url) as session:
        assert absent_hosts(session, list(session.scalars(select(Host)))) == {"h1"}


@pytest.mark.slow
def test_a_sigkilled_workers_job_is_retrying_within_10_s(tmp_path: Path, pg_url: str) -> None:
    settings = isolated_settings(tmp_path, pg_url, ingest_interval_s=0.3)  # heartbeats, staleness: the defaults
    assert settings.host_stale_after_s >= 30 and settings.heartbeat_interval_s >= 5
    spec = train_spec(tiny_data(settings), train_iters=100000, max_restarts=2)
    worker = start_worker(settings, "h1", 1, tmp_path / "h1.log")
    try:
        with leader_loops(settings):
            job_id = submit(settings, spec)
            wait_for(settings, job_id, lambda r: r.state == "running", 240, "running")
            time.sleep(settings.heartbeat_interval_s)  # not just after a beat: any moment of the heartbeat cycle
            os.kill(worker.pid, signal.SIGKILL)
            killed = time.monotonic()
            worker.wait()
            row = wait_for(settings, job_id, lambda r: r.state == "retrying", 10, "retrying within 10 s")
            took = time.monotonic() - killed
    finally:
        stop_worker(worker)
    assert took <= 10, took
    assert row.attempt_count == 1, log_text(settings, job_id)
    with session_scope(settings.database_url) as session:
        host = session.get(Host, "h1")
        node = session.scalars(select(JobNode).where(JobNode.job_id == job_id)).one()
    assert host is not None and host.state == "down"
    assert node.state == "lost" and node.reason == "host h1 stopped heart-beating"
    deadline = time.monotonic() + 30
    while job_processes(job_id) and time.monotonic() < deadline:  # the engine dies with its worker
        time.sleep(0.2)
    assert job_processes(job_id) == []


@pytest.mark.slow
def test_a_worker_stopped_cleanly_says_goodbye(tmp_path: Path, pg_url: str) -> None:
    settings = isolated_settings(tmp_path, pg_url, ingest_interval_s=0.3, cancel_grace_s=3)
    spec = train_spec(tiny_data(settings), train_iters=100000, max_restarts=2)
    worker = start_worker(settings, "h1", 1, tmp_path / "h1.log")
    try:
        with leader_loops(settings):
            job_id = submit(settings, spec)
            wait_for(settings, job_id, lambda r: r.state == "running", 240, "running")
            worker.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            row = wait_for(settings, job_id, lambda r: r.state == "retrying", 20, "retrying after the goodbye")
            took = time.monotonic() - stopped
            worker.wait(30)
    finally:
        stop_worker(worker)
    assert took <= settings.cancel_grace_s + 5, took
    assert row.error_code is None and row.retry_not_before is None  # the service stopped, not the job: no backoff
    with session_scope(settings.database_url) as session:
        host = session.get(Host, "h1")
        node = session.scalars(select(JobNode).where(JobNode.job_id == job_id)).one()
    assert host is not None and host.state == "down"
    assert node.state == "exited" and node.reason == "worker_stopped"
