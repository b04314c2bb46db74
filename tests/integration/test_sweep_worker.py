"""A sweep on PostgreSQL with a real `llmjobs worker` training tiny models: its trials are real train jobs whose
loss stream the median pruner reads; the sweep ends naming its best trial and that trial's checkpoint."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.settings import Settings
from core.sweeps import drive
from core_support import auth, fresh_postgres_database, isolated_settings, make_token, team_dir
from sched_support import start_worker, stop_worker, train_spec, write_tiny_data

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
TRIALS = int(os.environ.get("LLMJOBS_SWEEP_TRIALS", "4"))  # 12 for the figure in the issue


@pytest.fixture
def settings(tmp_path: Path, postgres_url: str) -> Iterator[Settings]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield isolated_settings(tmp_path, url, heartbeat_interval_s=1.0, ingest_interval_s=0.2, cancel_grace_s=3.0)


def test_a_sweep_of_real_trials_names_its_best(settings: Settings, tmp_path: Path) -> None:
    (team_dir(settings, "t") / "tiny").mkdir(parents=True, exist_ok=True)
    data = write_tiny_data(team_dir(settings, "t") / "tiny" / "d")
    base = train_spec(data, train_iters=8, save="out/ckpt")
    base.pop("lr")
    body = {
        "name": "tiny-lr",
        "base": {**base, "save": None},
        "space": {"lr": {"low": 1e-4, "high": 3e-2, "log": True}},
        "metric": "lm_loss",
        "max_trials": TRIALS,
        "max_parallel": 2,
        "sampler": "random",
        "pruner": "median",
        "n_startup_trials": 2,
        "n_warmup_steps": 2,
        "seed": 3,
    }
    worker = start_worker(settings, "sweep-host", 2, tmp_path / "worker.log")
    started = time.monotonic()
    try:
        with TestClient(create_app(settings, reconcile=False)) as client:
            headers = auth(make_token(settings, "t"))
            created = client.post("/v1/sweeps", json=body, headers=headers)
            assert created.status_code == 201, created.text
            sweep_id = created.json()["id"]
            deadline = time.monotonic() + 120 * TRIALS
            while drive(settings, sweep_id) == "running":  # the leader's loop, in the test's hands
                assert time.monotonic() < deadline, client.get(f"/v1/sweeps/{sweep_id}", headers=headers).text
                time.sleep(1)
            sweep = client.get(f"/v1/sweeps/{sweep_id}", headers=headers).json()
    finally:
        stop_worker(worker)
    elapsed = time.monotonic() - started
    assert sweep["state"] == "succeeded", sweep
    states = [t["state"] for t in sweep["trials"]]
    assert len(states) == TRIALS and set(states) <= {"succeeded", "pruned"}
    done = {t["job_id"]: t["value"] for t in sweep["trials"] if t["state"] == "succeeded"}
    result = sweep["result"]
    assert result["best_job"] == min(done, key=lambda job: done[job]) and result["best_value"] == min(done.values())
    print(f"sweep: {len(states)} trials, {states.count('pruned')} pruned, {elapsed:.0f} s; best {result}")
