"""Redis: SSE streams are pushed by pub/sub (not waiting for a poll), and the production setup
(PostgreSQL + Redis broker + a real `llmjobs worker`) runs a real preprocess job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, select

from app.main import create_app
from cli.demo import demo_spec, prepare_demo
from core.db import session_scope
from core.dispatch import dispatch
from core.jobs import create_job, transition
from core.models import Host, Job, LogLine
from core.paths import team_areas
from core.pubsub import notify
from core.states import JobState
from core_support import auth, fresh_postgres_database, isolated_settings, make_job, make_token, team_dir
from engine.contract.spec import parse_spec

pytestmark = pytest.mark.redis


def test_sse_is_pushed_through_redis(tmp_path: Path, redis_url: str) -> None:
    # A 60 s poll interval: only a pub/sub message can deliver the rows within the few seconds asserted below.
    settings = isolated_settings(tmp_path, redis_url=redis_url, stream_poll_s=60)
    job_id = make_job(settings, team="a")
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.starting) and transition(session, job_id, JobState.running)

    def worker_writes() -> None:
        time.sleep(1.0)
        with session_scope(settings.database_url) as session:
            session.execute(insert(LogLine), [{"job_id": job_id, "stream": "launcher", "seq": 0, "text": "pushed"}])
        notify(redis_url, job_id, logs=1)
        time.sleep(0.5)
        with session_scope(settings.database_url) as session:
            transition(session, job_id, JobState.succeeded)
        notify(redis_url, job_id, state=1)

    writer = threading.Thread(target=worker_writes)
    with TestClient(create_app(settings, reconcile=False)) as client:
        started = time.monotonic()
        writer.start()
        events = []
        with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=auth(make_token(settings, "a"))) as response:
            for line in response.iter_lines():
                if line.startswith("event:"):
                    events.append(line.split(":", 1)[1].strip())
                if line.startswith("data:") and events[-1] == "log":
                    assert json.loads(line[5:])["text"] == "pushed"
        elapsed = time.monotonic() - started
    writer.join()
    assert events[-3:] == ["log", "state", "end"]
    assert elapsed < 15, f"stream took {elapsed:.1f}s: it waited for a poll instead of the push"


@pytest.fixture
def production_env(tmp_path: Path, postgres_url: str, redis_url: str) -> Iterator[dict[str, str]]:
    with fresh_postgres_database(postgres_url, migrated=True) as database_url:
        yield {
            "LLMJOBS_VAR_DIR": str(tmp_path / "var"),
            "LLMJOBS_DATABASE_URL": database_url,
            "LLMJOBS_BROKER_URL": redis_url,
            "LLMJOBS_REDIS_URL": redis_url,
            "LLMJOBS_QUEUE_PREFIX": f"test{uuid.uuid4().hex[:8]}",
            "LLMJOBS_HEARTBEAT_INTERVAL_S": "1",
        }


@pytest.mark.slow
@pytest.mark.postgres
def test_worker_runs_a_job_with_postgres_and_redis_broker(production_env: dict[str, str]) -> None:
    settings = isolated_settings(
        Path(production_env["LLMJOBS_VAR_DIR"]),
        production_env["LLMJOBS_DATABASE_URL"],
        broker_url=production_env["LLMJOBS_BROKER_URL"],
        redis_url=production_env["LLMJOBS_REDIS_URL"],
        queue_prefix=production_env["LLMJOBS_QUEUE_PREFIX"],
    )
    prepare_demo(team_dir(settings, "prod"))
    raw = demo_spec()
    with session_scope(settings.database_url) as session:
        job, _ = create_job(
            session,
            settings=settings,
            team="prod",
            spec=parse_spec(raw, **team_areas(settings, "prod").context()),
            raw=raw,
        )
    assert dispatch(settings, job.id, job.queue)  # the message waits in Redis until a worker starts
    worker = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "worker", "--host", "pg-redis-host", "--concurrency", "1"],
        env={**os.environ, **production_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        state = _wait_terminal(settings.database_url, job.id, timeout=150)
        with session_scope(settings.database_url) as session:
            host = session.get(Host, "pg-redis-host")
            assert host is not None and host.state == "up" and host.device_type == "cpu"
            lines = session.scalars(select(LogLine.text).where(LogLine.job_id == job.id)).all()
        assert state == "succeeded", "\n".join(lines[-20:])
        assert any("preprocess summary" in line for line in lines)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _wait_terminal(database_url: str, job_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with session_scope(database_url) as session:
            state = session.scalar(select(Job.state).where(Job.id == job_id))
        if state and JobState(state).is_terminal():
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {state} after {timeout}s")
