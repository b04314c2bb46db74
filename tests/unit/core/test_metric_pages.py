"""GET /metrics pages never skip or repeat a point, whatever the limit (property test), and events filter by type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy import insert

from core.db import session_scope
from core.models import Event, MetricPoint
from core.settings import Settings
from core_support import auth, isolated_settings, make_job, set_job_spec


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


POINTS = st.lists(
    st.tuples(st.integers(0, 6), st.sampled_from(["lm_loss", "grad_norm", "mem"]), st.sampled_from([None, 0, 1, 2])),
    max_size=60,
)


def _store(settings: Settings, job_id: str, rows: list[dict[str, Any]]) -> None:
    with session_scope(settings.database_url) as session:
        if rows:
            session.execute(insert(MetricPoint), rows)
        session.commit()


def _pages(client: TestClient, token: str, job_id: str, limit: int, **params: Any) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    after = None
    for _ in range(1000):
        query = {"limit": limit, **params, **({"after": after} if after else {})}
        page = client.get(f"/v1/jobs/{job_id}/metrics", params=query, headers=auth(token))
        assert page.status_code == 200, page.text
        body = page.json()
        seen += body["data"]
        after = body["next_cursor"]
        if not body["has_more"]:
            return seen
    raise AssertionError("paging did not end")


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(points=POINTS, limit=st.integers(1, 12), names=st.sampled_from([None, "lm_loss", "lm_loss,mem"]))
def test_cursor_pages_return_every_point_once(
    client: TestClient,
    token: str,
    settings: Settings,
    points: list[tuple[int, str, int | None]],
    limit: int,
    names: str | None,
) -> None:
    job_id = make_job(settings, team="alpha")
    rows = [
        {"job_id": job_id, "step": s, "name": n, "rank": r, "value": float(i)} for i, (s, n, r) in enumerate(points)
    ]
    _store(settings, job_id, rows)  # inserted out of step order, as ingestion of several ranks does
    wanted = set(names.split(",")) if names else None
    latest = {(r["step"], r["name"], r["rank"]): r for r in rows}  # a point logged again replaces the earlier one
    expected = sorted((r["step"], r["value"]) for r in latest.values() if wanted is None or r["name"] in wanted)
    got = _pages(client, token, job_id, limit, **({"names": names} if names else {}))
    assert sorted((p["step"], p["value"]) for p in got) == expected
    assert [p["step"] for p in got] == sorted(p["step"] for p in got)


def test_a_redone_step_appears_once_with_its_attempt(client: TestClient, token: str, settings: Settings) -> None:
    """A retry that resumes from an earlier checkpoint logs steps again: each shows once, as the latest attempt
    measured it, and every point says which attempt that was; device telemetry keeps every sample."""
    from datetime import datetime, timedelta, timezone

    from core.models import Attempt

    job_id = make_job(settings, team="alpha")
    t0 = datetime.now(timezone.utc) - timedelta(minutes=10)
    at = [t0 + timedelta(seconds=s) for s in range(10)]
    with session_scope(settings.database_url) as session:
        session.execute(insert(Attempt), [{"job_id": job_id, "number": 1, "started_at": at[0]}])
        session.execute(insert(Attempt), [{"job_id": job_id, "number": 2, "started_at": at[5]}])
        session.commit()
    point = {"job_id": job_id, "name": "lm_loss", "rank": None}
    _store(
        settings,
        job_id,
        [{**point, "step": s, "value": 1.0, "time": at[s]} for s in (1, 2, 3)]  # attempt 1, then lost
        + [{**point, "name": "sys_util_pct", "rank": 0, "step": 3, "value": v, "time": at[3]} for v in (5.0, 6.0)]
        + [{**point, "step": s, "value": 2.0, "time": at[4 + s]} for s in (2, 3, 4)],  # attempt 2 resumed at 1
    )
    got = _pages(client, token, job_id, 100)
    loss = [(p["step"], p["value"], p["attempt"]) for p in got if p["name"] == "lm_loss"]
    assert loss == [(1, 1.0, 1), (2, 2.0, 2), (3, 2.0, 2), (4, 2.0, 2)]
    assert [p["value"] for p in got if p["name"] == "sys_util_pct"] == [5.0, 6.0]


def test_one_step_larger_than_the_limit_is_not_cut(client: TestClient, token: str, settings: Settings) -> None:
    job_id = make_job(settings, team="alpha")
    _store(
        settings,
        job_id,
        [{"job_id": job_id, "step": s, "name": f"m{i}", "rank": None, "value": 1.0} for s in (1, 2) for i in range(19)],
    )
    assert len(_pages(client, token, job_id, 5)) == 38
    bad = client.get(f"/v1/jobs/{job_id}/metrics", params={"after": "x:1"}, headers=auth(token))
    assert bad.status_code == 400 and bad.json()["field"] == "after"


def test_events_filter_by_type(client: TestClient, token: str, settings: Settings) -> None:
    job_id = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(Event),
            [
                {"job_id": job_id, "type": t, "message": t, "data": {}}
                for t in ("progress", "checkpoint", "warning", "checkpoint")
            ],
        )
        session.commit()
    url = f"/v1/jobs/{job_id}/events"
    only = client.get(url, params={"type": "checkpoint"}, headers=auth(token)).json()["data"]
    assert [e["type"] for e in only] == ["checkpoint", "checkpoint"]
    two = client.get(url, params={"type": "state,warning"}, headers=auth(token)).json()["data"]
    assert [e["type"] for e in two] == ["state", "warning"]  # make_job's "queued" state event, then the warning


def test_train_jobs_carry_trained_tokens_and_estimated_finish(
    client: TestClient, token: str, settings: Settings
) -> None:
    from datetime import datetime, timedelta, timezone

    job_id = make_job(settings, team="alpha")
    start = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=40)  # step 4 is "now"
    with session_scope(settings.database_url) as session:
        set_job_spec(session, job_id, {"kind": "train", "train_iters": 10}, state="running", started_at=start)
        session.commit()
    rows = [
        {
            "job_id": job_id,
            "step": s,
            "name": "tokens",
            "rank": None,
            "value": 100.0 * s,
            "time": start + timedelta(seconds=10 * s),
        }
        for s in (1, 2, 2, 3, 4)
    ]  # step 2 twice: a resumed attempt
    rows.append({"job_id": job_id, "step": 4, "name": "tokens", "rank": 0, "value": 9e9, "time": start})
    _store(settings, job_id, rows)
    job = client.get(f"/v1/jobs/{job_id}", headers=auth(token)).json()
    assert job["trained_tokens"] == 100 + 200 + 300 + 400
    finish = datetime.fromisoformat(job["estimated_finish"].replace("Z", "+00:00"))
    assert start + timedelta(seconds=100) <= finish < start + timedelta(seconds=160)  # 10 s a step, 6 to go
    listed = client.get("/v1/jobs", headers=auth(token)).json()["data"]
    assert [j["trained_tokens"] for j in listed if j["id"] == job_id] == [1000]


def test_estimated_finish_is_never_in_the_past_while_running() -> None:
    from datetime import datetime, timedelta, timezone

    from app.api.jobs import estimate_finish

    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    on_pace = estimate_finish(start, start + timedelta(seconds=40), 4, 10, now=start + timedelta(seconds=40))
    assert on_pace == start + timedelta(seconds=100)
    stalled_now = start + timedelta(hours=2)  # a restart (or a stall) since the last step
    assert estimate_finish(start, start + timedelta(seconds=40), 4, 10, now=stalled_now) == stalled_now + timedelta(
        seconds=60
    )
    # a retry's started_at after the previous attempt's last step: no negative pace
    assert estimate_finish(start, start - timedelta(seconds=5), 4, 10, now=start) == start
