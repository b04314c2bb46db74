"""The examples that are not plain job specs (examples/sweeps/, examples/mlflow/), against the demo data: the 12-trial
LoRA sweep runs on a real worker, prunes at least a third of its trials and names its best; the report_to example is
accepted once its token secret exists and its server's host is allowed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cli.demo import prepare_demo
from core_support import isolated_settings, team_dir
from demo_fixtures import demo_client, demo_settings
from sched_support import log_text, start_worker, stop_worker, wait_terminal

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    return json.loads((EXAMPLES / f"{name}.json").read_text())


def test_the_report_to_example_is_accepted(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, webhook_allowed_hosts=["127.0.0.1"])
    prepare_demo(team_dir(settings, "demo"))
    with demo_client(settings) as (client, headers):
        spec = example("mlflow/train-lora-report-to")
        missing = client.post("/v1/jobs", json=spec, headers=headers)
        assert missing.status_code == 422 and missing.json()["field"] == "mlflow_token_secret", missing.text
        assert client.put("/v1/secrets/mlflow-token", json={"value": "t"}, headers=headers).status_code == 200
        answer = client.post("/v1/jobs", json=spec, headers=headers)
        # on to the data checks: the LoRA run reads what 01-preprocess writes
        assert answer.status_code == 422 and answer.json()["field"] == "data_path", answer.text


@pytest.mark.slow
@pytest.mark.timeout(900)  # 12 tiny LoRA trials, two at a time, on this machine's shared CPUs
def test_the_sweep_example_prunes_a_third_and_names_its_best(tmp_path: Path) -> None:
    settings = demo_settings(tmp_path)
    worker = start_worker(settings, "demo-host", 2, tmp_path / "worker.log")
    try:
        with demo_client(settings) as (client, headers):
            prep = client.post("/v1/jobs", json=example("01-preprocess"), headers=headers).json()
            assert wait_terminal(settings, prep["id"], 300).state == "succeeded"
            started = time.monotonic()
            created = client.post("/v1/sweeps", json=example("sweeps/lora-12-trials"), headers=headers)
            assert created.status_code == 201, created.text
            url = f"/v1/sweeps/{created.json()['id']}"
            while (sweep := client.get(url, headers=headers).json())["state"] == "running":
                assert time.monotonic() - started < 840, sweep
                time.sleep(2)
            elapsed = time.monotonic() - started
    finally:
        stop_worker(worker)
    states = [t["state"] for t in sweep["trials"]]
    failed = [t["job_id"] for t in sweep["trials"] if t["state"] not in ("succeeded", "pruned")]
    assert sweep["state"] == "succeeded" and not failed, [log_text(settings, j)[-2000:] for j in failed]
    assert len(states) == 12 and states.count("pruned") >= 4, states
    done = {t["job_id"]: t["value"] for t in sweep["trials"] if t["state"] == "succeeded"}
    assert sweep["result"]["best_job"] == min(done, key=lambda job: done[job])
    print(f"demo sweep: 12 trials, {states.count('pruned')} pruned, {elapsed:.0f} s; best {sweep['result']}")
