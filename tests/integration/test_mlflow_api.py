"""The official MLflow client against the service's /api/2.0/mlflow/ (the app served by uvicorn on a free port): a
notebook logs runs, searches, pages and reads histories; a job submitted through /v1/jobs is a run with its metrics;
another team's token sees nothing.

The client (mlflow 3.x) cannot share the service's environment (its pins on starlette, protobuf and opentelemetry
conflict with constraints.txt), so it runs in its own interpreter: LLMJOBS_MLFLOW_PYTHON, else var/mlflow-venv (see
the README's MLflow section)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from core.db import session_scope
from core.jobs import transition
from core.settings import REPO_ROOT, Settings
from core.states import JobState
from core_support import auth, claim, isolated_settings, make_token, require_tool, team_dir
from engine.contract.runfiles import RunDir
from service_support import serve_in_thread
from worker.ingest import RunIngestor

NOTEBOOK = Path(__file__).with_name("mlflow_notebook.py")


def mlflow_python() -> str | None:
    """An interpreter with the mlflow client: LLMJOBS_MLFLOW_PYTHON, var/mlflow-venv, or this one."""
    for candidate in (os.environ.get("LLMJOBS_MLFLOW_PYTHON"), str(REPO_ROOT / "var/mlflow-venv/bin/python")):
        if candidate and Path(candidate).exists():
            return candidate
    return sys.executable if importlib.util.find_spec("mlflow") else None


PYTHON = mlflow_python()
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _mlflow_client() -> None:
    require_tool(
        PYTHON, "no interpreter with the mlflow client: run scripts/mlflow-setup.sh or set LLMJOBS_MLFLOW_PYTHON"
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Settings]]:
    settings = isolated_settings(tmp_path_factory.mktemp("mlflow-api"))
    data = team_dir(settings, "alpha")
    (data / "in.jsonl").write_text('{"text": "hi"}\n')
    (data / "tok").mkdir()
    with serve_in_thread(create_app(settings, migrate=False, reconcile=False)) as url:
        yield url, settings


def notebook(url: str, token: str, *args: str) -> Any:
    assert PYTHON is not None
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": url,
        "MLFLOW_TRACKING_TOKEN": token,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    done = subprocess.run(
        [PYTHON, str(NOTEBOOK), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_job(url: str, settings: Settings, token: str, tmp_path: Path) -> str:
    """A preprocess job submitted through /v1/jobs whose worker-side run files report two steps, then succeeded."""
    body = {
        "kind": "preprocess",
        "name": "prep-1",
        "input": "in.jsonl",
        "tokenizer_name_or_path": "tok",
        "output_prefix": "out/x",
        "metadata": {"experiment": "jobs-exp", "owner": "ana"},
    }
    answer = httpx.post(f"{url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert answer.status_code == 201, answer.text
    job_id = answer.json()["id"]
    assert claim(settings, job_id, "h0")
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.running)
    run = RunDir(tmp_path / "run")
    ingest = RunIngestor(settings.database_url, job_id, run.path, attempt=1)
    run.metric(1, {"lm_loss": 2.5, "grad_norm": float("nan")}, {0: {"mem_allocated_mb": 12.0}})
    run.metric(2, {"lm_loss": 2.0})
    ingest.poll(final=True)
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.succeeded, result={"kind": "preprocess", "outputs": {}})
    return job_id


def test_the_mlflow_client_logs_searches_and_reads_jobs(service: tuple[str, Settings], tmp_path: Path) -> None:
    url, settings = service
    alpha, beta = make_token(settings, "alpha"), make_token(settings, "beta")
    job_id = run_job(url, settings, alpha, tmp_path)

    logged = notebook(url, alpha, "log", "nb-exp")
    assert logged["changed_param"] == "INVALID_PARAMETER_VALUE"

    seen = notebook(url, alpha, "read", "nb-exp", "jobs-exp", job_id)
    assert seen["low_loss"] == [["c", 0.5], ["a", 1.5]]
    first, rest, token = seen["pages"]
    assert (first, rest, token) == (["c", "a"], ["b"], None)
    run_a = seen["run_a"]
    assert run_a["params"]["lr"] == "0.1" and run_a["params"]["optimizer"] == "adamw" and run_a["params"]["p100"] == "v"
    assert run_a["note"] == "last" and run_a["status"] == "FINISHED" and run_a["grad_norm_is_nan"]
    assert run_a["loss_history"] == [[0, 3.0], [1, 1.5]]
    assert run_a["m_points"] == 1001
    assert seen["bad_filter"] == "INVALID_PARAMETER_VALUE"

    [job] = seen["job_runs"]
    assert job["run_id"] == job_id and job["name"] == "prep-1"
    assert job["params"]["kind"] == "preprocess" and job["params"]["output_prefix"].endswith("out/x")
    assert job["tags"]["llmjobs.state"] == "succeeded" and job["tags"]["owner"] == "ana"
    assert job["tags"]["mlflow.runName"] == "prep-1"
    assert job["metrics"]["lm_loss"] == 2.0 and job["history"] == [[1, 2.5], [2, 2.0]]
    assert seen["job_run_read_only"] == "PERMISSION_DENIED"

    other = notebook(url, beta, "outsider", "nb-exp", logged["runs"]["a"])
    assert other == {
        "experiment": False,
        "get_run": "RESOURCE_DOES_NOT_EXIST",
        "search": [],
        "log": "RESOURCE_DOES_NOT_EXIST",
    }
    assert notebook(url, beta, "outsider", "jobs-exp", job_id)["get_run"] == "RESOURCE_DOES_NOT_EXIST"

    unknown = notebook(url, "llmj_revoked-or-made-up", "stranger", "nb-exp")
    assert unknown["search"]["code"] == "UNAUTHENTICATED" and "invalid or revoked token" in unknown["search"]["message"]
    assert unknown["set_experiment"] == "UNAUTHENTICATED"


@pytest.mark.parametrize(("field", "count"), [("metrics", 1001), ("params", 101), ("tags", 101)])
def test_a_batch_over_the_limits_is_refused(service: tuple[str, Settings], field: str, count: int) -> None:
    url, settings = service
    headers = auth(make_token(settings, "gamma"))
    created = httpx.post(f"{url}/api/2.0/mlflow/runs/create", json={"experiment_id": "0"}, headers=headers)
    run_id = created.json()["run"]["info"]["run_id"]
    items: dict[str, dict[str, Any]] = {
        "metrics": {"value": 1.0, "timestamp": 1},
        "params": {"value": "v"},
        "tags": {"value": "v"},
    }
    item = items[field]
    body = {"run_id": run_id, field: [{"key": f"k{i}", **item} for i in range(count)]}
    answer = httpx.post(f"{url}/api/2.0/mlflow/runs/log-batch", json=body, headers=headers, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error_code"] == "INVALID_PARAMETER_VALUE" and str(count) in answer.json()["message"]
    fits = {**body, field: body[field][:-1]}
    assert httpx.post(f"{url}/api/2.0/mlflow/runs/log-batch", json=fits, headers=headers, timeout=30).json() == {}
