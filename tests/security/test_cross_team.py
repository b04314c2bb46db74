"""Finding 5: nothing in a team's answers names or reveals another team's jobs."""

from __future__ import annotations

from fastapi.testclient import TestClient

from core.db import session_scope
from core.models import Host
from core.scheduler import schedule
from core.settings import Settings
from core_support import auth, make_job, make_token


def _host(settings: Settings, devices: int) -> None:
    with session_scope(settings.database_url) as session:
        session.add(
            Host(
                name="h1",
                device_type="cpu",
                devices=devices,
                device_ids=list(range(devices)),
                queue="host.h1",
                address="127.0.0.1",
                state="up",
                info={},
            )
        )


def test_pending_reason_counts_the_jobs_ahead_without_naming_them(client: TestClient, settings: Settings) -> None:
    _host(settings, 1)
    make_job(settings, team="alpha")  # runs
    mine = make_job(settings, team="alpha")
    first_waiting = make_job(settings, team="other")
    also = make_job(settings, team="other")
    schedule(settings)  # alpha holds the device, so other's first job is the one waiting for it (fair_order)
    answer = client.get(f"/v1/jobs/{mine}", headers=auth(make_token(settings, "alpha"))).json()
    reason = answer["pending_reason"]
    # the blocked job, plus the held-back jobs queued earlier (none): core.scheduler.behind_counts
    assert reason == "waiting behind 1 job (higher priority or queued earlier) for cpu devices"
    assert not any(job_id in reason for job_id in (first_waiting, also))


def test_after_another_teams_job_reads_like_an_unknown_id(client: TestClient, settings: Settings) -> None:
    theirs = make_job(settings, team="other")
    make_job(settings, team="alpha")
    token = make_token(settings, "alpha")
    unknown = client.get("/v1/jobs", params={"after": "job_does_not_exist"}, headers=auth(token))
    foreign = client.get("/v1/jobs", params={"after": theirs}, headers=auth(token))
    assert foreign.status_code == unknown.status_code == 400
    assert foreign.json() == {
        **unknown.json(),
        "message": unknown.json()["message"].replace("job_does_not_exist", theirs),
    }
    admin = make_token(settings, "ops", admin=True)
    assert client.get("/v1/jobs", params={"after": theirs}, headers=auth(admin)).status_code == 200
