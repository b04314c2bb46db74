"""report_to mlflow sends the team secret the spec names as its bearer token: the tracking server here is this
service's own /api/2.0/mlflow/ (served by uvicorn on a free port), which refuses a request without a good token, so
the mirrored run exists only when the token went along. The token is in no job row, spec or event."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.main import create_app
from core import team_secrets
from core.db import session_scope
from core.mlflow_report import report_once
from core.models import Event, Job
from core.settings import Settings
from core_support import auth, isolated_settings, make_token
from engine.contract.runfiles import RunDir
from service_support import serve_in_thread
from test_mlflow_report import train_job
from worker.ingest import RunIngestor


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Settings]]:
    settings = isolated_settings(tmp_path / "var", webhook_allowed_hosts=["127.0.0.1"])
    with serve_in_thread(create_app(settings, migrate=False, reconcile=False)) as url:  # no leader loops: the test
        yield url, settings  # runs the report pass itself


def test_the_named_secret_is_the_bearer_token(served: tuple[str, Settings], tmp_path: Path) -> None:
    url, settings = served
    receiver = make_token(settings, "alpha")  # the tracking server's account: a token of team alpha there
    with session_scope(settings.database_url) as session:
        team_secrets.put(session, settings, "beta", "tracker", receiver)
    job_id = train_job(settings, url, "beta", mlflow_token_secret="tracker", mlflow_experiment="mirrored")
    anonymous = train_job(settings, url, "beta", mlflow_experiment="anonymous")  # no secret: the server says 401
    run = RunDir(tmp_path / "run")
    ingest = RunIngestor(settings.database_url, job_id, run.path, attempt=1)  # reads what is written after it starts
    run.metric(1, {"lm_loss": 2.0})
    run.metric(2, {"lm_loss": 1.5})
    ingest.poll(final=True)

    assert report_once(settings) == 1  # the one with the token; the other failed

    api = f"{url}/api/2.0/mlflow"
    exp = httpx.get(f"{api}/experiments/get-by-name", params={"experiment_name": "mirrored"}, headers=auth(receiver))
    found = httpx.post(
        f"{api}/runs/search",
        json={"experiment_ids": [exp.json()["experiment"]["experiment_id"]]},
        headers=auth(receiver),
    ).json()
    [mirror] = found["runs"]
    tags = {t["key"]: t["value"] for t in mirror["data"]["tags"]}
    assert tags["llmjobs.job_id"] == job_id
    history = httpx.get(
        f"{api}/metrics/get-history",
        params={"run_id": mirror["info"]["run_id"], "metric_key": "lm_loss"},
        headers=auth(receiver),
    ).json()
    assert [(m["step"], m["value"]) for m in history["metrics"]] == [(1, 2.0), (2, 1.5)]

    with session_scope(settings.database_url) as session:
        rows = session.scalars(select(Job)).all()
        events = session.scalars(select(Event)).all()
        warnings = [e.message for e in events if e.job_id == anonymous and e.type == "warning"]
    assert all(receiver not in str(j.spec) and receiver not in str(j.meta) for j in rows)
    assert all(receiver not in e.message for e in events)
    assert len(warnings) == 1 and "401" in warnings[0] and "UNAUTHENTICATED" in warnings[0]
