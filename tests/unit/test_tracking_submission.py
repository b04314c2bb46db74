"""report_to at submission (``core.tracking``): a tracking server the webhook rule refuses is a 422 naming the field,
for a train job, a pipeline's train step and a sweep's base spec; an address an admin allows passes that check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.settings import Settings
from core_support import auth, isolated_settings, make_token

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
        "http://example.com",  # public, but plain http
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
