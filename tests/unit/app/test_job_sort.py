"""GET /v1/jobs?sort=: every sort key pages with the one-id cursor without skipping or repeating a job (ties and
blanks included), blanks last either way, 422 naming the choices for an unknown key; on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.main import create_app
from core.db import session_scope
from core.jobs import SORTS
from core.models import Job
from core.settings import Settings
from core_support import auth, fresh_postgres_database, isolated_settings, make_job, make_token

Seeded = tuple[TestClient, str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    """One database per backend, seeded once: the client, a token and the jobs."""
    tmp = tmp_path_factory.mktemp("sort")
    with ExitStack() as stack:
        server = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
        url = stack.enter_context(fresh_postgres_database(server, migrated=True)) if server else None
        settings = isolated_settings(tmp, database_url=url)
        rows = _jobs(settings)
        client = stack.enter_context(TestClient(create_app(settings, reconcile=False)))
        yield client, make_token(settings, "alpha"), rows


def _jobs(settings: Settings) -> list[dict[str, Any]]:
    """Seven jobs with ties (two names, two hosts), blanks (no name, never started) and one created_at shared."""
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = [
        {"name": "b", "state": "running", "host": "h2", "started": 5, "attempts": 1},
        {"name": "a", "state": "queued", "host": None, "started": None, "attempts": 0},
        {"name": None, "state": "succeeded", "host": "h1", "started": 2, "attempts": 1},
        {"name": "b", "state": "failed", "host": "h1", "started": 2, "attempts": 3},
        {"name": "c", "state": "queued", "host": None, "started": None, "attempts": 0},
        {"name": None, "state": "running", "host": "h2", "started": 9, "attempts": 2},
        {"name": "a", "state": "succeeded", "host": "h1", "started": 1, "attempts": 1},
    ]
    for i, row in enumerate(rows):
        row["id"] = make_job(settings, team="alpha", **({"name": row["name"]} if row["name"] else {}))
        started = base + timedelta(minutes=row["started"]) if row["started"] is not None else None
        with session_scope(settings.database_url) as session:
            session.execute(
                update(Job)
                .where(Job.id == row["id"])
                .values(
                    state=row["state"],
                    host=row["host"],
                    started_at=started,
                    attempt_count=row["attempts"],
                    created_at=base + timedelta(hours=min(i, 5)),
                )
            )  # the last two share a created_at
    return rows


def _expected(rows: list[dict[str, Any]], sort: str) -> list[str]:
    field = {
        "name": "name",
        "state": "state",
        "host": "host",
        "started_at": "started",
        "attempt_count": "attempts",
        "created_at": "order",
    }[sort.lstrip("-")]
    for i, row in enumerate(rows):
        row["order"] = min(i, 5)
    desc = sort.startswith("-")
    present = sorted((r for r in rows if r[field] is not None), key=lambda r: (r[field], r["id"]), reverse=desc)
    blanks = sorted((r for r in rows if r[field] is None), key=lambda r: r["id"], reverse=desc)
    return [r["id"] for r in present + blanks]


@pytest.mark.parametrize(
    "sort",
    ["name", "-name", "state", "-host", "started_at", "-started_at", "attempt_count", "created_at", "-created_at"],
)
def test_every_sort_pages_exactly(seeded: Seeded, sort: str) -> None:
    client, token, rows = seeded
    whole = client.get("/v1/jobs", params={"sort": sort, "limit": 50}, headers=auth(token)).json()["data"]
    assert [j["id"] for j in whole] == _expected(rows, sort)
    seen: list[str] = []
    after = None
    for _ in range(10):  # two a page: every boundary (a tie, the first blank) is crossed by a cursor
        page = client.get(
            "/v1/jobs", params={"sort": sort, "limit": 2, **({"after": after} if after else {})}, headers=auth(token)
        ).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == _expected(rows, sort)


def test_default_is_newest_first_and_unknown_sort_is_422(seeded: Seeded) -> None:
    client, token, rows = seeded
    default = client.get("/v1/jobs", params={"limit": 50}, headers=auth(token)).json()["data"]
    assert [j["id"] for j in default] == _expected(rows, "-created_at")
    for bad in ("spec", "--name", "name,state", "id"):
        answer = client.get("/v1/jobs", params={"sort": bad}, headers=auth(token))
        assert answer.status_code == 422, bad
        assert answer.json()["field"] == "sort" and "created_at" in answer.json()["message"]
    assert {"created_at", "name", "state", "started_at", "finished_at"} <= set(SORTS)
