"""report_to mlflow against a real ``mlflow server`` (SQLite backend) started here: the job's params, every job-wide
metric point with its step (over several 1,000-point batches) and its final state arrive; a server that is down costs
the job nothing but one warning event.

The server (mlflow 3.x) runs from its own interpreter (see test_mlflow_api.py): LLMJOBS_MLFLOW_PYTHON's directory or
var/mlflow-venv."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from core.db import session_scope
from core.jobs import create_job, transition
from core.mlflow_report import report_once
from core.models import Event, Job
from core.settings import REPO_ROOT, Settings
from core.states import JobState
from core_support import claim, isolated_settings, require_tool
from engine.contract.runfiles import RunDir
from engine.contract.spec import parse_spec
from service_support import free_port
from worker.ingest import RunIngestor


def mlflow_cli() -> Path | None:
    python = os.environ.get("LLMJOBS_MLFLOW_PYTHON") or str(REPO_ROOT / "var/mlflow-venv/bin/python")
    cli = Path(python).parent / "mlflow"
    return cli if cli.exists() else None


CLI = mlflow_cli()
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _mlflow_server_installed() -> None:
    require_tool(CLI, "no mlflow server: run scripts/mlflow-setup.sh or set LLMJOBS_MLFLOW_PYTHON")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    where = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [str(CLI), "server", "--backend-store-uri", f"sqlite:///{where / 'mlflow.db'}"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(where / "server.log", "wb") as out:
        proc = subprocess.Popen(command, cwd=where, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (where / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def train_job(settings: Settings, uri: str, team: str = "alpha", **spec: Any) -> str:
    """A running train job asking for report_to mlflow, stored as the API stores one."""
    raw = {"kind": "train", "name": "lora-r8", "metadata": {"experiment": "from-label"}, "data_path": ["data/x"]}
    raw |= {"train_iters": 2, "lr": 0.0003, "lora_r": 8, "report_to": ["mlflow"], "mlflow_tracking_uri": uri}
    raw |= {"resources": {"device_type": "cpu", "nnodes": 1, "nproc_per_node": 1}, **spec}
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team=team, spec=parse_spec(raw), raw=raw)
        job_id = job.id
    assert claim(settings, job_id, "h0")
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.running)
    return job_id


def remote(url: str, method: str, path: str, **kw: Any) -> Any:
    answer = httpx.request(method, f"{url}/api/2.0/mlflow/{path}", timeout=30, **kw)
    assert answer.status_code == 200, answer.text
    return answer.json()


def history(url: str, run_id: str, key: str) -> list[tuple[int, Any]]:
    found = remote(url, "GET", "metrics/get-history", params={"run_id": run_id, "metric_key": key})
    return sorted((int(m.get("step", 0)), m["value"]) for m in found.get("metrics", []))


def test_a_job_is_mirrored_to_a_real_mlflow_server(mlflow_server: str, tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "var", webhook_allowed_hosts=["127.0.0.1"])
    job_id = train_job(settings, mlflow_server, mlflow_experiment="lora-sweep")
    run = RunDir(tmp_path / "run")
    ingest = RunIngestor(settings.database_url, job_id, run.path, attempt=1)
    run.metric(1, {"lm_loss": 3.0, "grad_norm": float("nan")}, {0: {"mem_allocated_mb": 12.0}})
    run.metric(2, {"lm_loss": 2.5})
    ingest.poll()
    assert report_once(settings) == 1

    exp = remote(mlflow_server, "GET", "experiments/get-by-name", params={"experiment_name": "lora-sweep"})
    found = remote(mlflow_server, "POST", "runs/search", json={"experiment_ids": [exp["experiment"]["experiment_id"]]})
    [mirror] = found["runs"]
    run_id = mirror["info"]["run_id"]
    params = {p["key"]: p["value"] for p in mirror["data"]["params"]}
    tags = {t["key"]: t["value"] for t in mirror["data"]["tags"]}
    assert params["lr"] == "0.0003" and params["lora_r"] == "8" and params["resources.device_type"] == "cpu"
    assert tags["llmjobs.job_id"] == job_id and tags["experiment"] == "from-label"
    assert mirror["info"]["status"] == "RUNNING" and mirror["info"]["run_name"] == "lora-r8"
    assert history(mlflow_server, run_id, "lm_loss") == [(1, 3.0), (2, 2.5)]
    assert history(mlflow_server, run_id, "grad_norm") == [(1, "NaN")]
    assert history(mlflow_server, run_id, "mem_allocated_mb") == []  # per-device telemetry stays here

    for step in range(3, 2503):  # 2,500 more points: three log-batch requests
        run.metric(step, {"lm_loss": 1.0 / step})
    ingest.poll(final=True)
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.succeeded, result={"kind": "train", "outputs": {}})
    assert report_once(settings) == 1
    losses = history(mlflow_server, run_id, "lm_loss")
    assert [s for s, _ in losses] == list(range(1, 2503)) and losses[-1][1] == pytest.approx(1.0 / 2502)
    final = remote(mlflow_server, "GET", "runs/get", params={"run_id": run_id})["run"]["info"]
    assert final["status"] == "FINISHED" and int(final["end_time"]) > 0
    assert report_once(settings) == 0  # finished: not sent again


def test_a_server_that_is_down_costs_the_job_nothing(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "var", webhook_allowed_hosts=["127.0.0.1"])
    job_id = train_job(settings, f"http://127.0.0.1:{free_port()}")  # nobody listens there
    run = RunDir(tmp_path / "run")
    ingest = RunIngestor(settings.database_url, job_id, run.path, attempt=1)
    run.metric(1, {"lm_loss": 3.0})
    ingest.poll(final=True)
    started = time.monotonic()
    assert report_once(settings) == 0
    assert report_once(settings) == 0  # within the backoff: not tried again, no second warning
    assert time.monotonic() - started < 5
    with session_scope(settings.database_url) as session:
        warnings = session.scalars(select(Event).where(Event.job_id == job_id, Event.type == "warning")).all()
        job = session.get(Job, job_id)
        assert job is not None and job.state == "running"
    assert len(warnings) == 1 and "report_to mlflow" in warnings[0].message and "job goes on" in warnings[0].message


def test_an_internal_address_not_allowed_is_refused_once(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "var")  # 127.0.0.1 not among webhook_allowed_hosts
    job_id = train_job(settings, "http://127.0.0.1:1")
    assert report_once(settings) == 0
    assert report_once(settings) == 0
    with session_scope(settings.database_url) as session:
        warnings = session.scalars(select(Event).where(Event.job_id == job_id, Event.type == "warning")).all()
    assert len(warnings) == 1 and "mlflow_tracking_uri" in warnings[0].message and "mirror stops" in warnings[0].message
