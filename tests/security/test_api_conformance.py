"""Issue 39 finding 6 (schemathesis conformance): an upload without bytes is refused, and the patterns the OpenAPI
document gives for GET /v1/jobs' ``sort`` and ``state`` admit exactly what the server takes."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from core.jobs import SORTS
from core.settings import Settings
from core.states import JobState
from core_support import auth, make_token, team_dir


def test_an_upload_without_bytes_is_400_and_leaves_nothing(client: TestClient, settings: Settings) -> None:
    token = make_token(settings, "alpha")
    answer = client.put("/v1/files/empty.jsonl", content=b"", headers=auth(token))
    assert answer.status_code == 400 and answer.json()["field"] == "body", answer.text
    assert not (team_dir(settings, "alpha") / "uploads" / "empty.jsonl").exists()
    assert client.put("/v1/files/one.jsonl", content=b"x", headers=auth(token)).status_code == 201


def _pattern(client: TestClient, name: str) -> re.Pattern[str]:
    params = client.get("/openapi.json").json()["paths"]["/v1/jobs"]["get"]["parameters"]
    return re.compile(next(p for p in params if p["name"] == name)["schema"]["pattern"])


def test_documented_sort_and_state_patterns_match_the_server(client: TestClient, settings: Settings) -> None:
    token = make_token(settings, "alpha")
    cases = {
        "sort": [*SORTS, *(f"-{k}" for k in SORTS), "", " name ", "   ", "-", "nope", "created_at,name"],
        "state": ["", "queued", "queued, running", *(s.value for s in JobState), "queued,,running", "nope", " "],
    }
    for name, values in cases.items():
        pattern = _pattern(client, name)
        for value in values:
            status = client.get("/v1/jobs", params={name: value}, headers=auth(token)).status_code
            assert (status == 200) == bool(pattern.search(value)), (name, value, status)


def test_metrics_latest_ids_are_job_id_characters(client: TestClient, settings: Settings) -> None:
    # Under the server's 64 KiB request line even at the 7,400-character limit (uvicorn answers longer lines itself).
    answer = client.get("/v1/metrics/latest", params={"ids": "é" * 10}, headers=auth(make_token(settings, "alpha")))
    assert answer.status_code == 422 and "ids" in answer.json()["field"]
