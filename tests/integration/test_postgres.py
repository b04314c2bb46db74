"""The same code path on the real PostgreSQL: migrations, API, JSON metadata filters, CAS claims under real concurrency,
ingest. Each test session gets a fresh database (the `test` database itself is never dropped)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.main import create_app
from core.db import get_engine, session_scope
from core.models import Base, Job, MetricPoint
from core.settings import Settings
from core_support import auth, fresh_postgres_database, isolated_settings, make_job, make_token, race_claims, team_dir
from engine.contract.runfiles import RunDir
from worker.ingest import RunIngestor

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def pg_database(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url) as url:
        yield url


@pytest.fixture
def settings(tmp_path: Path, pg_database: str) -> Settings:
    settings = isolated_settings(tmp_path, database_url=pg_database)
    return settings


def test_migrations_match_models_on_postgres(settings: Settings) -> None:
    with get_engine(settings.database_url).connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []


def test_api_on_postgres(settings: Settings) -> None:
    team = f"team-{uuid.uuid4().hex[:6]}"
    token = make_token(settings, team)
    (team_dir(settings, team) / "in.jsonl").write_text("{}\n")
    (team_dir(settings, team) / "tok").mkdir()  # admission: the tokenizer directory must exist
    body = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"}
    with TestClient(create_app(settings, reconcile=False)) as client:
        ids = [
            client.post("/v1/jobs", json={**body, "metadata": {"exp": str(i % 2)}}, headers=auth(token)).json()["id"]
            for i in range(3)
        ]
        replay = client.post("/v1/jobs", json=body, headers={**auth(token), "Idempotency-Key": "same"})
        again = client.post("/v1/jobs", json=body, headers={**auth(token), "Idempotency-Key": "same"})
        assert replay.status_code == again.status_code == 201 and replay.json()["id"] == again.json()["id"]
        assert (
            client.post(
                "/v1/jobs", json={**body, "name": "x"}, headers={**auth(token), "Idempotency-Key": "same"}
            ).status_code
            == 409
        )
        odd = client.get("/v1/jobs", params={"metadata[exp]": "1"}, headers=auth(token)).json()["data"]
        assert [j["id"] for j in odd] == [ids[1]]
        page = client.get("/v1/jobs", params={"limit": 2}, headers=auth(token)).json()
        rest = client.get("/v1/jobs", params={"limit": 2, "after": page["last_id"]}, headers=auth(token)).json()
        assert len(page["data"]) + len(rest["data"]) == 4 and not rest["has_more"]
        cancelled = client.post(f"/v1/jobs/{ids[0]}/cancel", headers=auth(token)).json()
        assert cancelled["state"] == "cancelled" and cancelled["finished_at"]
        assert client.get(f"/v1/jobs/{ids[0]}", headers=auth(make_token(settings, "other"))).status_code == 404


def test_concurrent_claims_on_postgres(settings: Settings) -> None:
    job_id = make_job(settings)
    wins = race_claims(settings, job_id, workers=8)
    assert len(wins) == 1


def test_ingest_on_postgres(settings: Settings, tmp_path: Path) -> None:
    job_id = make_job(settings)
    run_dir = tmp_path / "run"
    ingest = RunIngestor(settings.database_url, job_id, run_dir, attempt=1)
    RunDir(run_dir).metric(3, {"lm_loss": float("nan"), "lr": 0.5})
    assert ingest.poll(final=True)["metrics"] == 2
    with session_scope(settings.database_url) as session:
        values = {p.name: p.value for p in session.scalars(select(MetricPoint).where(MetricPoint.job_id == job_id))}
        assert values == {"lm_loss": None, "lr": 0.5}
        assert session.get(Job, job_id).heartbeat_at is not None  # type: ignore[union-attr]
