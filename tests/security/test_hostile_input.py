"""Finding 3: hostile input is a 4xx with the error shape and stores nothing, on SQLite and on PostgreSQL; job
metadata is held to the admin's size limits."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from security_support import give_inputs

from app.main import create_app
from core.settings import Settings
from core_support import (
    auth,
    fresh_postgres_database,
    isolated_settings,
    make_job,
    make_token,
)

BASE = '"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "out/x"'


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None
        return
    with fresh_postgres_database(request.getfixturevalue("postgres_url"), migrated=True) as url:
        yield url


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, database_url: str | None) -> Settings:
    """One service per database for the module: each test works as a team of its own (``team``), and what it
    checks is that team's (its jobs, its webhooks), so the tests share the database and the app."""
    return isolated_settings(tmp_path_factory.mktemp("hostile"), database_url=database_url)


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def team(settings: Settings) -> tuple[str, str]:
    name = f"t{uuid.uuid4().hex[:8]}"
    give_inputs(settings, name)
    return name, make_token(settings, name)


def _assert_refused(answer: Any, field: str | None = "any") -> None:
    assert 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])
    body = answer.json()
    assert {"code", "message", "field"} <= set(body), body
    if field != "any":
        assert body["field"] in (field, f"query.{field}"), body


def _assert_nothing_stored(client: TestClient, settings: Settings, token: str) -> None:
    mine = client.get("/v1/jobs", headers=auth(token))
    assert mine.status_code == 200 and mine.json()["data"] == [], mine.text[:300]
    everyone = client.get("/v1/jobs?limit=200", headers=auth(make_token(settings, "ops", admin=True)))
    assert everyone.status_code == 200, everyone.text[:300]


HOSTILE_BODIES = {
    "surrogate in metadata": "{" + BASE + r', "metadata": {"k": "\udfff"}}',
    "surrogate in a metadata key": "{" + BASE + r', "metadata": {"\udfff": "v"}}',
    "surrogate in name": "{" + BASE + r', "name": "a\udfffb"}',
    "surrogate in a path": r'{"kind": "preprocess", "input": "in\udfff.jsonl", "tokenizer_name_or_path": "tok", '
    r'"output_prefix": "out/x"}',
    "NUL in metadata": "{" + BASE + r', "metadata": {"k": "a\u0000b"}}',
    "NUL in name": "{" + BASE + r', "name": "a\u0000b"}',
    "NUL in a path": r'{"kind": "preprocess", "input": "in\u0000.jsonl", "tokenizer_name_or_path": "tok", '
    r'"output_prefix": "out/x"}',
    "JSON nested 10,000 deep": "{" + BASE + ', "metadata": ' + "[" * 10_000 + "]" * 10_000 + "}",
    "a body nested 10,000 deep": "[" * 10_000 + "]" * 10_000,
    "integer of 5,000 digits": "{" + BASE + ', "priority": 1' + "0" * 5_000 + "}",
    "integer beyond 64 bits": "{" + BASE + ', "max_restarts": 18446744073709551617}',
    "1e309": "{" + BASE + ', "start_deadline_s": 1e309}',
    "NaN": "{" + BASE + ', "run_deadline_s": NaN}',
}


@pytest.mark.parametrize("body", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_hostile_job_bodies_are_refused_and_nothing_is_stored(
    client: TestClient, settings: Settings, team: tuple[str, str], body: str
) -> None:
    answer = client.post(
        "/v1/jobs", content=body.encode(), headers={**auth(team[1]), "content-type": "application/json"}
    )
    _assert_refused(answer)
    _assert_nothing_stored(client, settings, team[1])


@pytest.mark.parametrize("text", ["a\u0000b", "a\udfffb"], ids=["NUL", "surrogate"])
def test_hostile_webhook_description_is_refused(client: TestClient, team: tuple[str, str], text: str) -> None:
    body = json.dumps({"url": "https://8.8.8.8/hook", "description": text}).encode()  # escapes: ASCII JSON
    answer = client.post("/v1/webhooks", content=body, headers={**auth(team[1]), "content-type": "application/json"})
    _assert_refused(answer, "description")
    assert client.get("/v1/webhooks", headers=auth(team[1])).json()["data"] == []


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs/job_%00x",
        "/v1/jobs/job_%00x/events",
        "/v1/webhooks/wh%00",
        "/v1/jobs?after=x%00",
        "/v1/jobs?name=a%00",
        "/v1/jobs?state=queued%00",
        "/v1/jobs?metadata[k]=a%00",
        "/v1/jobs?parent_id=%00",
    ],
)
def test_nul_in_a_path_id_or_query_is_refused(client: TestClient, team: tuple[str, str], path: str) -> None:
    _assert_refused(client.get(path, headers=auth(team[1])))


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("events?after=9223372036854775808", "after"),
        ("events?after=" + "9" * 40, "after"),
        ("logs?offset=2147483648", "offset"),
        ("logs?offset=9223372036854775808", "offset"),
        ("logs?rank=2147483648", "rank"),
        ("metrics?since_step=2147483648", "since_step"),
        ("metrics?since_step=-9223372036854775809", "since_step"),
        ("stream?after=9223372036854775808-0-0", "Last-Event-ID"),
    ],
)
def test_cursors_beyond_the_columns_are_refused(
    client: TestClient, settings: Settings, team: tuple[str, str], query: str, field: str
) -> None:
    job_id = make_job(settings, team=team[0])
    _assert_refused(client.get(f"/v1/jobs/{job_id}/{query}", headers=auth(team[1])), field)


def _submit(client: TestClient, token: str, metadata: dict[str, str]) -> Any:
    spec = {
        "kind": "preprocess",
        "input": "in.jsonl",
        "tokenizer_name_or_path": "tok",
        "output_prefix": "out/x",
        "metadata": metadata,
    }
    return client.post("/v1/jobs", json=spec, headers=auth(token))


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata"),
        ({"k": "v" * 513}, "metadata.k"),
        ({"label": "x" * 900_000}, "metadata.label"),
        ({f"key{i:02d}": "v" * 510 for i in range(16)}, "metadata"),  # each within limits, 8.2 KB together
    ],
)
def test_metadata_size_limits(
    client: TestClient, settings: Settings, team: tuple[str, str], metadata: dict[str, str], field: str
) -> None:
    _assert_refused(_submit(client, team[1], metadata), field)
    _assert_nothing_stored(client, settings, team[1])


def test_metadata_within_the_limits_is_accepted(client: TestClient, team: tuple[str, str]) -> None:
    answer = _submit(client, team[1], {f"key{i:02d}": "v" * 400 for i in range(16)})
    assert answer.status_code == 201, answer.text[:300]
