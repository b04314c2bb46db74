"""A service restart costs a running job one attempt at most: a shutting-down worker stops its engines and ends
their attempts as retryable (no training on with no API); a worker replaced on its host by a newer one neither marks
the host down nor sweeps the newer worker's nodes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.db import session_scope
from core.models import Host, Job
from core.scheduler import schedule
from core.states import HostState
from core_support import isolated_settings, make_job
from worker import node as worker_node
from worker.hosts import register_host, set_host_state
from worker.launcher import LaunchPlan
from worker.leases import NODE_ENV, node_token
from worker.node import claim_node, finish_node, mark_running, watch_node
from worker.supervisor import Supervised


@pytest.fixture
def stopping() -> Iterator[None]:
    yield
    worker_node.STOPPING.clear()


def test_a_stopping_worker_stops_its_engine_and_the_job_retries(tmp_path: Path, stopping: None) -> None:
    settings = isolated_settings(tmp_path, cancel_grace_s=2)
    register_host(settings, name="h1", device_type="cpu", devices=1, queues=["host.h1"])
    job_id = make_job(settings, max_restarts=2)
    schedule(settings)
    work = claim_node(settings, job_id, 1, 0, "h1")
    assert work is not None
    plan = LaunchPlan(
        [sys.executable, "-c", "import time; time.sleep(120)"], {NODE_ENV: node_token(job_id, 1, 0)}, tmp_path
    )
    proc = Supervised(plan, tmp_path / "launcher.log")
    mark_running(settings, work, proc.pid, plan.argv, "h1")

    worker_node.shut_down(settings, "h1")  # what celery's worker_shutting_down signal calls (worker.tasks)
    started = time.monotonic()
    code, stop = watch_node(settings, work, proc, None)
    assert stop == "worker_stopped" and code != 0 and proc.poll() is not None
    assert time.monotonic() - started < settings.cancel_grace_s + 5
    assert finish_node(settings, work, code, stop, None, time.monotonic() + 30) == "retrying"
    # The host went down first: the retry is not granted to the worker that is going away (a live replay of
    # `make run` + Ctrl-C used three attempts when it was), and that worker claims nothing more.
    assert schedule(settings) == []
    assert worker_node.run_node(settings, job_id, 2, 0, "h1") == "skipped"
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        host = session.get(Host, "h1")
        assert job is not None and job.state == "retrying" and job.attempt_count == 1
        assert host is not None and host.state == HostState.down.value
    # The next worker on the host registers it up, and the job's second attempt runs there.
    register_host(settings, name="h1", device_type="cpu", devices=1, queues=["host.h1"])
    assert [g.job_id for g in schedule(settings)] == [job_id]


def test_a_replaced_worker_does_not_mark_the_host_down(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    register_host(settings, name="h1", device_type="cpu", devices=1, queues=["host.h1"])  # this process: the old one
    with session_scope(settings.database_url) as session:
        host = session.get(Host, "h1")
        assert host is not None
        host.pid = os.getpid() + 1  # a newer worker registered the same host after a restart
    assert not set_host_state(settings, "h1", HostState.down, pid=os.getpid())  # the old one's exit
    with session_scope(settings.database_url) as session:
        assert session.get(Host, "h1").state == HostState.up.value  # type: ignore[union-attr]
    assert set_host_state(settings, "h1", HostState.down, pid=os.getpid() + 1)  # its own worker may
