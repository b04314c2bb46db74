"""The small read routes the dashboard needs beyond the feeds, on SQLite, in-process: the job list's latest values,
progress and device telemetry (GET /v1/metrics/latest), log search (?q=) and the events type filter (?type=)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert
from test_api import _record_run, settings, spec, submit  # noqa: F401 - settings: the data root fixture

from core.db import session_scope
from core.models import Event, LogLine, MetricPoint
from core.settings import Settings
from core_support import auth, make_token


def test_latest_values_and_progress_per_visible_job(client: TestClient, token: str, settings: Settings) -> None:  # noqa: F811 - the imported fixture
    done = submit(client, token, spec()).json()["id"]
    _record_run(settings, done)
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(Event), [{"job_id": done, "type": "progress", "message": "", "data": {"done": 7, "total": 9}}]
        )
        session.commit()
    fresh = submit(client, token, spec()).json()["id"]
    other_team = submit(client, make_token(settings, "beta"), spec()).json()["id"]
    got = client.get(
        "/v1/metrics/latest",
        params={"ids": f"{done},{fresh},{other_team},nope,{done}", "names": "lm_loss,loss"},
        headers=auth(token),
    )
    assert got.status_code == 200, got.text
    rows = got.json()["data"]
    assert [r["job_id"] for r in rows] == [done, fresh]  # another team's job and an unknown id are left out alike
    assert rows[0]["step"] == 3 and rows[0]["values"] == {"lm_loss": pytest.approx(2.0 / 3)}
    assert rows[0]["value_steps"] == {"lm_loss": 3} and rows[0]["progress"] == {"done": 7, "total": 9}
    assert rows[1] == {
        "job_id": fresh,
        "step": None,
        "values": {},
        "value_steps": {},
        "progress": None,
        "devices": None,
    }
    too_many = client.get(
        "/v1/metrics/latest", params={"ids": ",".join(f"j{i}" for i in range(201))}, headers=auth(token)
    )
    assert too_many.status_code == 400 and too_many.json()["field"] == "ids"


def test_log_search_and_event_type_filter(client: TestClient, token: str, settings: Settings) -> None:  # noqa: F811 - the imported fixture
    job_id = submit(client, token, spec()).json()["id"]
    _record_run(settings, job_id)  # lines "launcher 0..2", "rank0 0..2"; a progress event; four state events
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(LogLine),
            [
                {"job_id": job_id, "stream": "launcher", "seq": 3 + i, "text": t}
                for i, t in enumerate(["Traceback (most recent call last):", "50%_done", "ValueError: x"])
            ],
        )
        session.execute(
            insert(Event), [{"job_id": job_id, "type": "checkpoint", "message": "saved", "data": {"iteration": 2}}]
        )
        session.commit()

    def search(**params: object) -> list[tuple[int, str]]:
        got = client.get(f"/v1/jobs/{job_id}/logs", params=params, headers=auth(token))
        assert got.status_code == 200, got.text
        return [(line["seq"], line["text"]) for line in got.json()["data"]]

    assert search(q="traceback") == [(3, "Traceback (most recent call last):")]  # any case, with its line number
    assert search(q="%_") == [(4, "50%_done")]  # taken literally, not as LIKE wildcards
    assert search(q="launcher", offset=1) == [(1, "launcher 1"), (2, "launcher 2")]
    assert search(q="launcher", stream="rank0") == []
    events = client.get(f"/v1/jobs/{job_id}/events", params={"type": "checkpoint,progress"}, headers=auth(token)).json()
    assert [e["type"] for e in events["data"]] == ["progress", "checkpoint"]
    every = client.get(f"/v1/jobs/{job_id}/events", headers=auth(token)).json()["data"]
    assert {e["type"] for e in every} == {"state", "progress", "checkpoint"}


def test_latest_device_telemetry(client: TestClient, token: str, settings: Settings) -> None:  # noqa: F811 - the imported fixture
    job_id = submit(client, token, spec()).json()["id"]
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(MetricPoint),
            [
                {"job_id": job_id, "step": t, "name": n, "value": v + t, "rank": r}
                for t in (0, 5)
                for r in (0, 1)
                for n, v in (("sys_util_pct", 10.0 * r), ("sys_device_id", 3.0 + r - t))
            ]  # id: 3+r
            + [{"job_id": job_id, "step": 9, "name": "mem_allocated_mb", "value": 1.0, "rank": 0}],
        )
        session.commit()
    got = client.get("/v1/metrics/latest", params={"ids": job_id, "devices": "true"}, headers=auth(token)).json()[
        "data"
    ][0]
    assert got["devices"] == {
        "0": {"sys_util_pct": 5.0, "sys_device_id": 3.0},
        "1": {"sys_util_pct": 15.0, "sys_device_id": 4.0},
    }  # the newest sample of each
