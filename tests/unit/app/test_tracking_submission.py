"""report_to at submission (``core.tracking``): a tracking server the webhook rule refuses is a 422 naming the field,
for a train job, a pipeline's train step and a sweep's base spec; an address an admin allows passes that check. The
token is a team secret (``core.team_secrets``, sealed, never answered back) the spec names; a team's default
report_to (set by an admin) fills what a spec leaves unset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.main import create_app
from core import team_secrets, tracking
from core.db import session_scope
from core.errors import ApiError
from core.models import TeamSecret
from core.settings import Settings
from core_support import auth, isolated_settings, make_token
from engine.contract.spec import parse_spec, spec_to_json

TRAIN = {"kind": "train", "data_path": "ds", "train_iters": 4, "lr": 1e-4, "global_batch_size": 4}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def train(uri: str, **extra: Any) -> dict[str, Any]:
    return {**TRAIN, "report_to": ["mlflow"], "mlflow_tracking_uri": uri, **extra}


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:5000",  # loopback: the API host's own ports
        "https://10.0.0.7",  # private
        "https://169.254.169.254/latest",  # link-local: cloud metadata
        "https://[::ffff:192.168.1.1]",  # an IPv6 form of a private address
        "http://1.1.1.1",  # public, but plain http
    ],
)
def test_a_blocked_tracking_server_is_refused_naming_the_field(client: TestClient, token: str, uri: str) -> None:
    answer = client.post("/v1/jobs", json=train(uri), headers=auth(token))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "mlflow_tracking_uri" and "mlflow_tracking_uri" in answer.json()["message"]


def test_pipeline_steps_and_sweep_bases_are_checked_too(client: TestClient, token: str) -> None:
    steps = [{"name": "sft", "spec": train("https://10.1.2.3")}]
    answer = client.post("/v1/jobs", json={"kind": "pipeline", "steps": steps}, headers=auth(token))
    assert answer.status_code == 422 and answer.json()["field"] == "steps.0.spec.mlflow_tracking_uri", answer.text
    base = {k: v for k, v in train("http://127.0.0.1:1").items() if k != "kind"}
    sweep = {"name": "s", "base": base, "space": {"lr": {"low": 1e-5, "high": 1e-3}}, "max_trials": 2}
    answer = client.post("/v1/sweeps", json=sweep, headers=auth(token))
    assert answer.status_code == 422 and answer.json()["field"] == "base.mlflow_tracking_uri", answer.text


def test_an_internal_server_an_admin_allows_passes(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, webhook_allowed_hosts=["127.0.0.1"])
    with TestClient(create_app(settings, reconcile=False)) as client:
        answer = client.post("/v1/jobs", json=train("http://127.0.0.1:5000"), headers=auth(make_token(settings, "a")))
    assert answer.json().get("field") != "mlflow_tracking_uri", answer.text  # on to the next check (the data files)


def test_a_team_secret_is_stored_sealed_listed_by_name_and_kept_to_its_team(
    client: TestClient, token: str, settings: Settings
) -> None:
    answer = client.put("/v1/secrets/mlflow-token", json={"value": "tok-123-plain"}, headers=auth(token))
    assert answer.status_code == 200 and "value" not in answer.json() and answer.json()["team"] == "alpha"
    assert client.put("/v1/secrets/mlflow-token", json={"value": "tok-456"}, headers=auth(token)).status_code == 200
    with session_scope(settings.database_url) as session:
        [row] = session.scalars(select(TeamSecret)).all()
        assert row.value.startswith("fernet:") and "tok-456" not in row.value
        assert team_secrets.reveal(session, settings, "alpha", "mlflow-token") == "tok-456"
    listed = client.get("/v1/secrets", headers=auth(token)).json()["data"]
    assert [s["name"] for s in listed] == ["mlflow-token"] and "tok-456" not in str(listed)
    beta = auth(make_token(settings, "beta"))
    assert client.get("/v1/secrets", headers=beta).json()["data"] == []
    assert client.delete("/v1/secrets/mlflow-token", headers=beta).status_code == 404
    bad = client.put("/v1/secrets/..x", json={"value": "v"}, headers=auth(token))
    assert bad.status_code == 422 and bad.json()["field"] == "path.name", bad.text
    assert client.delete("/v1/secrets/mlflow-token", headers=auth(token)).status_code == 204
    assert client.get("/v1/secrets", headers=auth(token)).json()["data"] == []


def test_a_spec_names_a_secret_the_team_has(client: TestClient, token: str, settings: Settings) -> None:
    uri = "https://1.1.1.1"
    answer = client.post("/v1/jobs", json=train(uri, mlflow_token_secret="nope"), headers=auth(token))
    assert answer.status_code == 422 and answer.json()["field"] == "mlflow_token_secret", answer.text
    client.put("/v1/secrets/tok", json={"value": "s3cret-value"}, headers=auth(token))
    spec = parse_spec(train(uri, mlflow_token_secret="tok"))
    with session_scope(settings.database_url) as session:
        tracking.prepare(session, settings, "alpha", spec)  # passes: the secret is the team's
        with pytest.raises(ApiError) as refused:
            tracking.prepare(session, settings, "beta", spec)  # another team's secret of that name does not count
    assert refused.value.field == "mlflow_token_secret"
    stored = spec_to_json(spec)
    assert stored["mlflow_token_secret"] == "tok" and "s3cret-value" not in str(stored)


def test_the_team_default_fills_what_a_spec_leaves_unset(client: TestClient, token: str, settings: Settings) -> None:
    admin = auth(make_token(settings, "alpha", admin=True))
    default = {
        "report_to": ["mlflow"],
        "mlflow_tracking_uri": "https://1.1.1.1",
        "mlflow_experiment": "team",
    }
    assert client.put("/v1/teams/alpha/tracking", json=default, headers=auth(token)).status_code == 403
    blocked = client.put(
        "/v1/teams/alpha/tracking", json={**default, "mlflow_tracking_uri": "http://10.0.0.1"}, headers=admin
    )
    assert blocked.status_code == 422 and blocked.json()["field"] == "mlflow_tracking_uri", blocked.text
    nosecret = client.put("/v1/teams/alpha/tracking", json={**default, "mlflow_token_secret": "t"}, headers=admin)
    assert nosecret.status_code == 422 and nosecret.json()["field"] == "mlflow_token_secret"
    assert client.put("/v1/teams/alpha/tracking", json=default, headers=admin).status_code == 200
    assert client.get("/v1/teams/alpha/tracking", headers=auth(token)).json()["mlflow_experiment"] == "team"
    assert client.get("/v1/teams/alpha/tracking", headers=auth(make_token(settings, "beta"))).status_code == 404

    plain, own, opted_out = (
        parse_spec(TRAIN),
        parse_spec({**TRAIN, "mlflow_experiment": "mine"}),
        parse_spec({**TRAIN, "report_to": []}),
    )
    with session_scope(settings.database_url) as session:
        for spec in (plain, own, opted_out):
            tracking.prepare(session, settings, "alpha", spec)
        other_team = parse_spec(TRAIN)
        tracking.prepare(session, settings, "beta", other_team)
    assert spec_to_json(plain)["report_to"] == ["mlflow"] and spec_to_json(plain)["mlflow_experiment"] == "team"
    assert (
        spec_to_json(own)["mlflow_experiment"] == "mine"
        and spec_to_json(own)["mlflow_tracking_uri"] == default["mlflow_tracking_uri"]
    )
    assert spec_to_json(opted_out)["report_to"] == []  # no mirror (core.mlflow_report picks report_to "mlflow" only)
    assert "report_to" not in spec_to_json(other_team)
    missing = client.post(
        "/v1/jobs", json={**TRAIN, "report_to": ["mlflow"]}, headers=auth(make_token(settings, "gamma"))
    )
    assert missing.status_code == 422 and missing.json()["field"] == "mlflow_tracking_uri", missing.text
