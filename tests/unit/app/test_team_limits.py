"""Per-team limits at the API: priority ceilings (422 naming the field), unfinished jobs (429 with Retry-After in the
JSON error shape), and the per-replica slot counts behind the stream and upload limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.team_slots import TeamSlots
from core.errors import ApiError
from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(
        tmp_path, team_max_active_jobs=3, team_priority_ceiling=10, team_priority_ceilings={"ops": 100}
    )
    for team in ("alpha", "ops"):
        (team_dir(settings, team) / "in.jsonl").write_text('{"text": "hi"}\n')
        (team_dir(settings, team) / "tok").mkdir()
    return settings


def spec(**extra: Any) -> dict[str, Any]:
    return {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o", **extra}


def test_priority_above_the_team_ceiling_is_refused(client: TestClient, settings: Settings, token: str) -> None:
    answer = client.post("/v1/jobs", json=spec(priority=11), headers=auth(token))
    assert answer.status_code == 422
    assert answer.json()["field"] == "priority"
    assert "ceiling of 10" in answer.json()["message"]
    assert client.post("/v1/jobs", json=spec(priority=10), headers=auth(token)).status_code == 201
    ops = make_token(settings, "ops")  # an admin raised this team's ceiling
    assert client.post("/v1/jobs", json=spec(priority=100), headers=auth(ops)).status_code == 201


def test_a_pipeline_step_cannot_climb_above_the_ceiling(client: TestClient, token: str) -> None:
    pipeline = {"kind": "pipeline", "steps": [{"name": "a", "spec": spec(priority=50)}]}
    answer = client.post("/v1/jobs", json=pipeline, headers=auth(token))
    assert answer.status_code == 422
    assert answer.json()["field"] == "steps.0.spec.priority"


def test_unfinished_jobs_past_the_limit_get_429(client: TestClient, settings: Settings, token: str) -> None:
    for _ in range(2):
        assert client.post("/v1/jobs", json=spec(), headers=auth(token)).status_code == 201
    keyed = {**auth(token), "Idempotency-Key": "k1"}
    first = client.post("/v1/jobs", json=spec(), headers=keyed)
    assert first.status_code == 201
    replay = client.post("/v1/jobs", json=spec(), headers=keyed)  # at the limit, yet the client learns its job
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.json()["id"] == first.json()["id"]
    answer = client.post("/v1/jobs", json=spec(), headers=auth(token))
    assert answer.status_code == 429
    assert answer.headers["Retry-After"] == str(settings.team_limit_retry_after_s)
    assert answer.json() == {
        "code": "too_many_jobs",
        "message": "team alpha has 3 unfinished jobs, its limit (team_max_active_jobs); retry when some finish",
        "field": None,
    }
    job = client.get("/v1/jobs", headers=auth(token)).json()["data"][0]["id"]
    assert client.post(f"/v1/jobs/{job}/cancel", headers=auth(token)).json()["state"] == "cancelled"
    assert client.post("/v1/jobs", json=spec(), headers=auth(token)).status_code == 201  # one finished: room again
    ops = make_token(settings, "ops")  # other teams are not counted against alpha's limit
    assert client.post("/v1/jobs", json=spec(), headers=auth(ops)).status_code == 201


def test_team_slots_count_per_team_and_come_back() -> None:
    slots = TeamSlots("uploads", 2, 7)
    slots.acquire("red")
    with slots.hold("red"):
        with pytest.raises(ApiError) as refused:
            slots.acquire("red")
        slots.acquire("blue")  # another team's count is its own
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "7"}
    slots.acquire("red")  # the held one came back
    unlimited = TeamSlots("uploads", 0, 7)
    for _ in range(100):
        unlimited.acquire("red")
