"""Sweeps over the API in process: refusals at submission naming the field; trials as train jobs, pruned from their
metric stream by the median pruner, the best named at the end; a grid visits each point once. Trials' metric points
and ends are written as the worker would (no worker runs here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from core.db import session_scope
from core.jobs import transition
from core.models import Event, Job, MetricPoint
from core.settings import Settings
from core.states import JobState
from core.sweeps import drive
from core_support import auth, claim, isolated_settings, make_token

BASE = {"data_path": "ds", "train_iters": 4, "lr": 1e-4, "global_batch_size": 4, "micro_batch_size": 2}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def sweep_body(**extra: Any) -> dict[str, Any]:
    return {
        "name": "lr-search",
        "base": BASE,
        "space": {"lr": {"low": 1e-5, "high": 1e-2, "log": True}, "lora_r": {"choices": [4, 8, 16]}},
        "metric": "val_lm_loss",
        "max_trials": 6,
        "max_parallel": 2,
        "sampler": "random",
        "pruner": "median",
        "n_startup_trials": 2,
        **extra,
    }


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"space": {"bogus": {"choices": [1]}}}, "space.bogus", "not a train spec field"),
        ({"space": {"resources": {"choices": [1]}}}, "space.resources", "not a train spec field"),
        ({"space": {"mlflow_token_secret": {"choices": ["a", "b"]}}}, "space.mlflow_token_secret", "not a train"),
        ({"space": {"global_batch_size": {"choices": [4, 3]}}}, "base.global_batch_size", "divisible"),
        ({"space": {"lr": {"low": 0.1, "high": 0.01}}}, "space.lr", "low < high"),
        ({"sampler": "grid"}, "space.lr", "needs choices"),
        ({"pruner": "hyperband"}, "max_resource", "required"),
        ({"base": {**BASE, "kind": "eval"}}, "base.kind", "train jobs"),
    ],
)
def test_a_sweep_that_cannot_run_is_refused(
    client: TestClient, token: str, change: dict[str, Any], field: str, text: str
) -> None:
    answer = client.post("/v1/sweeps", json=sweep_body(**change), headers=auth(token))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field and text in answer.json()["message"]


def finish(settings: Settings, job_id: str, losses: list[float], succeed: bool) -> None:
    """What the worker records of a trial: its metric points, and (if ``succeed``) its end."""
    with session_scope(settings.database_url) as session:
        have = session.scalar(select(MetricPoint.id).where(MetricPoint.job_id == job_id).limit(1))
        if have is None:
            for step, loss in enumerate(losses, start=1):
                session.add(MetricPoint(job_id=job_id, step=step, name="val_lm_loss", value=loss))
    if succeed:
        assert claim(settings, job_id, "h0")
        with session_scope(settings.database_url) as session:
            assert transition(session, job_id, JobState.running)
            outputs = {"checkpoint": f"runs/{job_id}/checkpoint"}
            assert transition(session, job_id, JobState.succeeded, result={"kind": "train", "outputs": outputs})


def test_trials_are_pruned_from_their_metrics_and_the_best_is_named(
    client: TestClient, token: str, settings: Settings
) -> None:
    created = client.post("/v1/sweeps", json=sweep_body(), headers=auth(token))
    assert created.status_code == 201, created.text
    sweep = created.json()
    assert [t["state"] for t in sweep["trials"]] == ["queued", "queued"]  # max_parallel
    for _ in range(20):
        sweep = client.get(f"/v1/sweeps/{sweep['id']}", headers=auth(token)).json()
        if sweep["state"] != "running":
            break
        for trial in sweep["trials"]:
            if trial["state"] != "queued":
                continue
            n = trial["number"]
            good = n < 2 or n % 2 == 0  # odd trials after the first two learn badly and stop after 2 steps
            losses = [1 + n / 100 + 1 / s for s in range(1, 5)] if good else [10 + 1 / s for s in (1, 2)]
            finish(settings, trial["job_id"], losses, succeed=good)
        drive(settings, sweep["id"], dispatch_now=False)
    assert sweep["state"] == "succeeded"
    states = {t["number"]: t["state"] for t in sweep["trials"]}
    assert states == {0: "succeeded", 1: "succeeded", 2: "succeeded", 3: "pruned", 4: "succeeded", 5: "pruned"}
    result = sweep["result"]
    best = sweep["trials"][0]
    assert result["best_job"] == best["job_id"] and result["best_value"] == pytest.approx(1.25)
    assert result["best_params"] == best["params"] and set(best["params"]) == {"lr", "lora_r"}
    assert result["best_outputs"] == {"checkpoint": f"runs/{best['job_id']}/checkpoint"}
    assert (result["trials"], result["completed"], result["pruned"]) == (6, 4, 2)
    pruned = [t["job_id"] for t in sweep["trials"] if t["state"] == "pruned"]
    with session_scope(settings.database_url) as session:
        for job_id in pruned:
            job = session.get(Job, job_id)
            assert job is not None and job.state == "cancelled" and job.kind == "train" and job.error_code == "pruned"
            assert session.scalar(select(Event.id).where(Event.job_id == job_id, Event.type == "pruned"))
        trial = session.get(Job, best["job_id"])
        assert trial is not None and trial.name == "lr-search/0"
        assert trial.meta["sweep"] == sweep["id"] and trial.meta["experiment"] == "lr-search"
        assert trial.spec["lr"] == best["params"]["lr"] and trial.spec["lora_r"] == best["params"]["lora_r"]


def test_a_grid_visits_each_point_once(client: TestClient, token: str, settings: Settings) -> None:
    body = sweep_body(
        space={"lora_r": {"choices": [4, 8]}, "lr": {"choices": [1e-4, 1e-3]}},
        sampler="grid",
        max_trials=4,
        max_parallel=4,
    )
    sweep = client.post("/v1/sweeps", json=body, headers=auth(token)).json()
    points = {(t["params"]["lora_r"], t["params"]["lr"]) for t in sweep["trials"]}
    assert points == {(4, 1e-4), (4, 1e-3), (8, 1e-4), (8, 1e-3)}
    with session_scope(settings.database_url) as session:
        assert len(session.scalars(select(Job).where(Job.kind == "train")).all()) == 4
    outsider = auth(make_token(settings, "beta"))
    assert client.get(f"/v1/sweeps/{sweep['id']}", headers=outsider).status_code == 404
    assert client.get("/v1/sweeps", headers=outsider).json()["data"] == []
    cancelled = client.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=auth(token)).json()
    assert cancelled["state"] == "cancelled" and {t["state"] for t in cancelled["trials"]} == {"cancelled"}
