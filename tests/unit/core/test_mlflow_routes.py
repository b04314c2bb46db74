"""/api/2.0/mlflow/ over HTTP in process, as MLflow's client sends it (int64 as strings, NaN as "NaN"): the shapes and
codes the client branches on, a job as a run, and the search grammar. The official client itself runs against the
served app in tests/integration/test_mlflow_api.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.db import session_scope
from core.mlflow_errors import MlflowError
from core.mlflow_search import RunView, parse_filter, parse_order_by, search
from core.models import MetricPoint
from core.settings import Settings
from core_support import auth, isolated_settings, make_job, make_token

API = "/api/2.0/mlflow"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def call(client: TestClient, token: str, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    answer = client.request(method, f"{API}/{path}", headers=auth(token), **kw)
    return answer.status_code, answer.json()


def test_a_notebook_run_round_trips(client: TestClient, token: str) -> None:
    status, body = call(client, token, "GET", "experiments/get-by-name", params={"experiment_name": "nb"})
    assert (status, body["error_code"]) == (404, "RESOURCE_DOES_NOT_EXIST")
    _, created = call(client, token, "POST", "experiments/create", json={"name": "nb"})
    assert call(client, token, "POST", "experiments/create", json={"name": "nb"})[1]["error_code"] == (
        "RESOURCE_ALREADY_EXISTS"
    )
    run = {"experiment_id": created["experiment_id"], "start_time": "1700000000000", "run_name": "r1"}
    _, made = call(client, token, "POST", "runs/create", json=run)
    run_id = made["run"]["info"]["run_id"]
    ref = {"run_id": run_id, "run_uuid": run_id}
    points = [
        {"key": "loss", "value": "NaN", "timestamp": "1", "step": "0"},
        {"key": "loss", "value": "Infinity", "timestamp": "2", "step": "1"},
        {"key": "loss", "value": 0.5, "timestamp": "3", "step": "2"},
    ]
    assert call(client, token, "POST", "runs/log-batch", json={**ref, "metrics": points})[0] == 200
    assert call(client, token, "POST", "runs/log-parameter", json={**ref, "key": "lr", "value": "0.1"})[0] == 200
    assert call(client, token, "POST", "runs/log-parameter", json={**ref, "key": "lr", "value": "0.1"})[0] == 200
    status, body = call(client, token, "POST", "runs/log-parameter", json={**ref, "key": "lr", "value": "0.2"})
    assert (status, body["error_code"]) == (400, "INVALID_PARAMETER_VALUE") and "'0.1'" in body["message"]
    call(client, token, "POST", "runs/set-tag", json={**ref, "key": "t", "value": "1"})
    call(client, token, "POST", "runs/set-tag", json={**ref, "key": "t", "value": "2"})
    _, info = call(
        client, token, "POST", "runs/update", json={**ref, "status": "FINISHED", "end_time": "1700000001000"}
    )
    assert info["run_info"]["status"] == "FINISHED" and info["run_info"]["end_time"] == 1700000001000

    _, page = call(client, token, "GET", "metrics/get-history", params={**ref, "metric_key": "loss", "max_results": 2})
    assert [(m["step"], m["value"]) for m in page["metrics"]] == [(0, "NaN"), (1, "Infinity")]
    params = {**ref, "metric_key": "loss", "max_results": 2, "page_token": page["next_page_token"]}
    _, rest = call(client, token, "GET", "metrics/get-history", params=params)
    assert [(m["step"], m["value"]) for m in rest["metrics"]] == [(2, 0.5)] and "next_page_token" not in rest

    _, got = call(client, token, "GET", "runs/get", params={"run_id": run_id})
    data = got["run"]["data"]
    assert data["params"] == [{"key": "lr", "value": "0.1"}]
    assert {"key": "t", "value": "2"} in data["tags"] and {"key": "mlflow.runName", "value": "r1"} in data["tags"]
    assert data["metrics"] == [{"key": "loss", "value": 0.5, "timestamp": 3, "step": 2}]


def test_another_team_and_bad_input_get_mlflow_errors(client: TestClient, token: str, settings: Settings) -> None:
    _, made = call(client, token, "POST", "runs/create", json={"experiment_id": "0"})
    run_id = made["run"]["info"]["run_id"]
    outsider = make_token(settings, "beta")
    status, body = call(client, outsider, "GET", "runs/get", params={"run_id": run_id})
    assert (status, body["error_code"]) == (404, "RESOURCE_DOES_NOT_EXIST")
    _, found = call(
        client, outsider, "POST", "runs/search", json={"experiment_ids": ["0", made["run"]["info"]["experiment_id"]]}
    )
    assert found == {"runs": []}
    status, body = call(client, token, "POST", "runs/log-metric", json={"run_id": run_id, "key": "x", "value": "abc"})
    assert (status, body["error_code"]) == (400, "INVALID_PARAMETER_VALUE") and "value" in body["message"]
    status, body = call(client, token, "POST", "runs/search", json={"experiment_ids": ["0"], "page_token": "zz"})
    assert (status, body["error_code"]) == (400, "INVALID_PARAMETER_VALUE")
    anonymous = client.get(f"{API}/runs/get", params={"run_id": run_id})
    assert (anonymous.status_code, anonymous.json()["error_code"]) == (401, "UNAUTHENTICATED")
    status, body = call(client, "llmj_not-a-token", "POST", "runs/create", json={"experiment_id": "0"})
    assert (status, body["error_code"]) == (401, "UNAUTHENTICATED") and "invalid" in body["message"]
    call(client, token, "POST", "runs/set-tag", json={"run_id": run_id, "key": "k", "value": "v"})
    assert call(client, token, "POST", "runs/delete-tag", json={"run_id": run_id, "key": "k"}) == (200, {})
    status, body = call(client, token, "POST", "runs/delete-tag", json={"run_id": run_id, "key": "k"})
    assert (status, body["error_code"]) == (404, "RESOURCE_DOES_NOT_EXIST")
    status, body = call(client, token, "POST", "runs/delete", json={"run_id": run_id})
    assert (status, body["error_code"]) == (404, "ENDPOINT_NOT_FOUND") and "not supported" in body["message"]
    assert client.post(f"{API}/runs/delete", json={"run_id": run_id}).status_code == 401


def test_a_job_is_a_run_of_its_experiment(client: TestClient, token: str, settings: Settings) -> None:
    job_id = make_job(settings, "alpha", name="prep", metadata={"experiment": "sweeps", "owner": "ana"})
    other = make_job(settings, "alpha")  # no experiment label: the team's default experiment
    with session_scope(settings.database_url) as session:
        session.add_all(
            [
                MetricPoint(job_id=job_id, step=1, name="lm_loss", value=3.0),
                MetricPoint(job_id=job_id, step=1, name="lm_loss", value=9.0, rank=0),
                MetricPoint(job_id=job_id, step=2, name="lm_loss", value=None),
            ]
        )
    _, exp = call(client, token, "GET", "experiments/get-by-name", params={"experiment_name": "sweeps"})
    _, found = call(client, token, "POST", "runs/search", json={"experiment_ids": [exp["experiment"]["experiment_id"]]})
    [run] = found["runs"]
    assert run["info"]["run_id"] == job_id and run["info"]["status"] == "SCHEDULED"
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["owner"] == "ana" and tags["llmjobs.kind"] == "preprocess" and tags["mlflow.runName"] == "prep"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["input"] == "a" and "resources.device_type" in params and "metadata.owner" not in params
    _, history = call(client, token, "GET", "metrics/get-history", params={"run_id": job_id, "metric_key": "lm_loss"})
    assert [(m["step"], m["value"]) for m in history["metrics"]] == [(1, 3.0), (2, "NaN")]
    _, default = call(client, token, "POST", "runs/search", json={"experiment_ids": ["0"]})
    assert [r["info"]["run_id"] for r in default["runs"]] == [other]
    status, body = call(client, token, "POST", "runs/set-tag", json={"run_id": job_id, "key": "k", "value": "v"})
    assert (status, body["error_code"]) == (403, "PERMISSION_DENIED") and "is a job of the service" in body["message"]


def view(name: str, start: int, **data: Any) -> RunView:
    return RunView(attributes={"run_id": name, "run_name": name, "start_time": start, "status": "FINISHED"}, **data)


RUNS = [
    view("a", 1, metrics={"loss": 1.0}, params={"lr": "0.1"}, tags={"team": "Vision"}),
    view("b", 2, metrics={"loss": 3.0}, params={"lr": "0.01"}, tags={"team": "nlp"}),
    view("c", 3, metrics={"loss": math.nan}, params={"lr": "0.1"}),
    view("d", 4, params={"lr": "0.3"}),
]


@pytest.mark.parametrize(
    ("text", "order", "names"),
    [
        ("metrics.loss < 2", [], ["a"]),
        ("metrics.loss != 2", [], ["c", "b", "a"]),
        ("params.lr = '0.1' and attributes.run_name != 'c'", [], ["a"]),
        ("tags.\"team\" ILIKE 'vis%'", [], ["a"]),
        ("tags.team LIKE 'n_p'", [], ["b"]),
        ("params.lr IN ('0.01', '0.3')", ["params.lr DESC"], ["d", "b"]),
        ("params.`lr` NOT IN ('0.1')", [], ["d", "b"]),
        ("attributes.start_time >= 3", [], ["d", "c"]),
        ("", ["metrics.loss DESC"], ["b", "a", "d", "c"]),
        ("", ["metrics.`loss`"], ["a", "b", "d", "c"]),
    ],
)
def test_search_grammar(text: str, order: list[str], names: list[str]) -> None:
    found = search(RUNS, parse_filter(text), parse_order_by(order))
    assert [r.attributes["run_name"] for r in found] == names


@pytest.mark.parametrize(
    "text",
    [
        "metrics.loss < 'x'",
        "params.lr = 0.1",
        "metrics.loss < 2 OR params.lr = '1'",
        "datasets.name = 'x'",
        "attributes.colour = 'x'",
        "metrics.loss < 2 AND",
        "params.lr > '1'",
    ],
)
def test_search_grammar_refusals(text: str) -> None:
    with pytest.raises(MlflowError) as err:
        parse_filter(text)
    assert err.value.code == "INVALID_PARAMETER_VALUE" and err.value.status == 400
