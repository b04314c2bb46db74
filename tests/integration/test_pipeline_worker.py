"""Pipelines on PostgreSQL with a real `llmjobs worker` running real engine steps: cancelling a pipeline stops its
running step's processes and starts nothing after it; with on_failure=continue a real failure skips only the steps
that need its outputs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.main import create_app
from core.db import session_scope
from core.models import Job, MetricPoint
from core.settings import Settings
from core_support import auth, fresh_postgres_database, isolated_settings, make_token, team_dir
from sched_support import (
    job_processes,
    job_row,
    log_text,
    start_worker,
    stop_worker,
    train_spec,
    wait_terminal,
    write_tiny_data,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def settings(tmp_path: Path, postgres_url: str) -> Iterator[Settings]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield isolated_settings(tmp_path, url, heartbeat_interval_s=1.0, ingest_interval_s=0.2, cancel_grace_s=3.0)


@pytest.fixture
def api(settings: Settings, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    worker = start_worker(settings, "pipe-host", 1, tmp_path / "worker.log")
    try:
        with TestClient(create_app(settings, reconcile=False)) as client:
            yield client, auth(make_token(settings, "t"))
    finally:
        stop_worker(worker)


def submit(client: TestClient, headers: dict[str, str], steps: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json={"kind": "pipeline", "steps": steps, **extra}, headers=headers)
    assert response.status_code == 201, response.text
    return response.json()


def tiny_data(settings: Settings) -> str:
    (team_dir(settings, "t") / "tiny").mkdir(parents=True, exist_ok=True)
    return write_tiny_data(team_dir(settings, "t") / "tiny" / "d")


def metric_count(settings: Settings, job_id: str) -> int:
    with session_scope(settings.database_url) as session:
        return (
            session.scalar(
                select(func.count()).where(  # the engine's points, not the worker's sys_* telemetry
                    MetricPoint.job_id == job_id, MetricPoint.name.not_like("sys\\_%", escape="\\")
                )
            )
            or 0
        )


def children(settings: Settings, pipeline_id: str) -> list[Job]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(Job).where(Job.parent_id == pipeline_id)))


def test_cancel_stops_the_running_step_and_starts_nothing_after(
    settings: Settings, api: tuple[TestClient, dict[str, str]]
) -> None:
    client, headers = api
    data = tiny_data(settings)
    long = train_spec(data, train_iters=100_000, save="tiny/long")
    after = train_spec(data, load="${steps.long.outputs.checkpoint}")
    pipeline = submit(client, headers, [{"name": "long", "spec": long}, {"name": "after", "spec": after}])
    step = pipeline["steps"][0]["job_id"]
    deadline = time.monotonic() + 120
    while metric_count(settings, step) == 0:  # training for real
        assert time.monotonic() < deadline, log_text(settings, step)
        time.sleep(0.5)
    assert client.get(f"/v1/jobs/{pipeline['id']}", headers=headers).json()["state"] == "running"
    assert job_processes(step)

    cancelled = client.post(f"/v1/jobs/{pipeline['id']}/cancel", headers=headers).json()
    assert cancelled["state"] == "cancelling" and cancelled["steps"][0]["state"] == "cancelling"
    assert wait_terminal(settings, step, 60).state == "cancelled"
    assert wait_terminal(settings, pipeline["id"], 30).state == "cancelled"
    assert job_processes(step) == []
    time.sleep(2)  # a step that was going to start would be there by now
    assert [c.id for c in children(settings, pipeline["id"])] == [step]
    view = client.get(f"/v1/jobs/{pipeline['id']}", headers=headers).json()
    assert [s["state"] for s in view["steps"]] == ["cancelled", "skipped"]


def test_continue_skips_only_the_steps_that_need_a_failed_one(
    settings: Settings, api: tuple[TestClient, dict[str, str]]
) -> None:
    client, headers = api
    data = tiny_data(settings)
    for suffix in (".bin", ".idx"):  # passes admission (the files exist), fails in the engine (not a dataset)
        (team_dir(settings, "t") / "tiny" / f"corrupt_text_document{suffix}").write_bytes(b"not an index")
    steps = [
        {"name": "broken", "spec": train_spec("tiny/corrupt", save="tiny/broken", max_restarts=0)},
        {"name": "fine", "spec": train_spec(data, train_iters=2, save="tiny/fine")},
        {"name": "needs_broken", "spec": train_spec(data, load="${steps.broken.outputs.checkpoint}")},
    ]
    pipeline = submit(client, headers, steps, on_failure="continue")
    done = wait_terminal(settings, pipeline["id"], 240)
    view = client.get(f"/v1/jobs/{pipeline['id']}", headers=headers).json()
    assert [s["state"] for s in view["steps"]] == ["failed", "succeeded", "skipped"], view
    broken = job_row(settings, view["steps"][0]["job_id"])
    assert broken.error_code == "bad_input" and broken.attempt_count == 1  # a user error is never retried
    assert done.state == "failed" and done.error_message == "steps failed: broken; skipped: needs_broken"
    assert metric_count(settings, view["steps"][1]["job_id"]) > 0
    assert done.result["outputs"]["fine.checkpoint"] == str(team_dir(settings, "t") / "tiny" / "fine")
