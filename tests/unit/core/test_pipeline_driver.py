"""Pipelines through the in-process API on SQLite, with the children's outcomes written as a worker writes them:
step order, reference resolution, fail_fast vs continue, cancel, 422s naming the field, GET listing the steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core import pipelines
from core.db import session_scope
from core.jobs import transition
from core.models import Job
from core.recovery import recover
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, team_dir


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path)
    data = team_dir(settings, "alpha")
    (data / "in.jsonl").write_text('{"text": "hi"}\n')
    (data / "tok").mkdir()
    (data / "hf").mkdir()  # what admission reads of an HF model: config.json beside safetensors
    (data / "hf" / "config.json").write_text('{"num_attention_heads": 4, "num_hidden_layers": 2}')
    (data / "hf" / "model.safetensors").write_bytes(b"")
    return settings


def steps() -> list[dict[str, Any]]:
    return [
        {
            "name": "prep",
            "spec": {
                "kind": "preprocess",
                "input": "in.jsonl",
                "tokenizer_name_or_path": "tok",
                "output_prefix": "out/x",
            },
        },
        {
            "name": "tomg",
            "spec": {
                "kind": "convert",
                "load_model_type": "hf",
                "save_model_type": "mg",
                "load_dir": "hf",
                "save_dir": "mg",
            },
        },
        {
            "name": "train",
            "spec": {
                "kind": "train",
                "data_path": "${steps.prep.outputs.data_path}",
                "load": "${steps.tomg.outputs.checkpoint}",
                "save": "ckpt",
                "train_iters": 2,
                "lr": 1e-4,
                "seq_length": 32,
            },
        },
        {
            "name": "tohf",
            "spec": {
                "kind": "convert",
                "load_model_type": "mg",
                "save_model_type": "hf",
                "load_dir": "${steps.train.outputs.checkpoint}",
                "save_dir": "final",
            },
        },
    ]


def submit(client: TestClient, token: str, **extra: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/jobs",
        json={"kind": "pipeline", "name": "p", "metadata": {"team_run": "7"}, "steps": steps(), **extra},
        headers=auth(token),
    )
    assert response.status_code == 201, response.text
    return response.json()


def finish_child(settings: Settings, job_id: str, state: JobState, outputs: dict[str, str] | None = None) -> None:
    """What a worker does: starting -> running -> outcome (with result.json's content on success); then the hook."""
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.starting, attempt_count=1)
        assert transition(session, job_id, JobState.running)
        values: dict[str, Any] = (
            {"result": {"kind": "x", "outputs": outputs or {}, "summary": {}}}
            if state is JobState.succeeded
            else {"error_code": "engine_error", "error_message": "boom"}
        )
        assert transition(session, job_id, state, **values)
    pipelines.advance_parent(settings, job_id)


def get(client: TestClient, token: str, job_id: str) -> dict[str, Any]:
    return client.get(f"/v1/jobs/{job_id}", headers=auth(token)).json()


def wait_for(read: Callable[[], Any], good: Callable[[Any], bool], timeout_s: float = 10) -> Any:
    """Poll ``read`` until ``good`` (the Dispatcher's pass runs beside the request); the last value either way."""
    deadline = time.monotonic() + timeout_s
    while not good(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_submission_leaves_scheduling_to_the_dispatcher(
    client: TestClient, token: str, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POST commits the pipeline and its first step's child and returns; no scheduling pass runs in the request
    (core.pipelines.dispatch is not called): the API's Dispatcher loop, woken by the submission, dispatches it."""
    in_request: list[str] = []
    monkeypatch.setattr(pipelines, "dispatch", lambda _s, job_id, _q: in_request.append(job_id))
    pipeline = submit(client, token)
    child_id = pipeline["steps"][0]["job_id"]
    assert pipeline["pending_reason"] == "step prep: waiting for the message to reach a worker"

    def dispatched() -> bool:
        with session_scope(settings.database_url) as session:
            child = session.get(Job, child_id)
            return child is not None and child.dispatched_at is not None

    assert wait_for(dispatched, bool) and in_request == []
    assert get(client, token, child_id)["pending_reason"].startswith("no live worker serves cpu devices")


def test_steps_run_in_order_with_references_resolved(client: TestClient, token: str, settings: Settings) -> None:
    pipeline = submit(client, token)
    assert [s["state"] for s in pipeline["steps"]] == ["queued", "pending", "pending", "pending"]
    assert wait_for(
        lambda: get(client, token, pipeline["id"])["pending_reason"],
        lambda reason: reason.startswith("step prep: no live worker serves cpu devices"),
    )
    data = team_dir(settings, "alpha")
    outputs = {
        "prep": {"data_path": str(data / "out/x_packed"), "files": "a"},
        "tomg": {"checkpoint": str(data / "mg")},
        "train": {"checkpoint": str(data / "ckpt")},
        "tohf": {"checkpoint": str(data / "final/mg2hf")},
    }
    for index, name in enumerate(outputs):
        view = get(client, token, pipeline["id"])
        step = view["steps"][index]
        assert step["name"] == name and step["state"] == "queued", view["steps"]
        child = get(client, token, step["job_id"])
        assert child["parent_id"] == pipeline["id"] and child["metadata"] == {"team_run": "7", "pipeline_step": name}
        if name == "train":  # resolved from the finished steps' result outputs
            assert child["spec"]["data_path"] == [str(data / "out/x_packed")]
            assert child["spec"]["load"] == str(data / "mg")
        finish_child(settings, step["job_id"], JobState.succeeded, outputs[name])
        if index < 3:
            assert get(client, token, pipeline["id"])["state"] == "running"
    done = get(client, token, pipeline["id"])
    assert done["state"] == "succeeded" and [s["state"] for s in done["steps"]] == ["succeeded"] * 4
    assert done["result"]["outputs"]["tohf.checkpoint"] == str(data / "final/mg2hf")
    listed = client.get(
        "/v1/jobs", params={"parent_id": pipeline["id"], "metadata[pipeline_step]": "train"}, headers=auth(token)
    ).json()["data"]
    assert [j["name"] for j in listed] == ["p/train"]  # <pipeline name>/<step>


def test_fail_fast_stops_at_the_first_failure(client: TestClient, token: str, settings: Settings) -> None:
    pipeline = submit(client, token)
    finish_child(settings, pipeline["steps"][0]["job_id"], JobState.failed)
    view = get(client, token, pipeline["id"])
    assert view["state"] == "failed" and view["error"]["code"] == "step_failed" and "prep" in view["error"]["message"]
    assert [s["state"] for s in view["steps"]] == ["failed", "skipped", "skipped", "skipped"]
    assert all(s["job_id"] is None for s in view["steps"][1:])


def test_continue_runs_independent_steps_and_skips_dependents(
    client: TestClient, token: str, settings: Settings
) -> None:
    pipeline = submit(client, token, on_failure="continue")
    finish_child(settings, pipeline["steps"][0]["job_id"], JobState.failed)
    view = get(client, token, pipeline["id"])
    assert view["state"] == "running" and view["steps"][1]["state"] == "queued"  # tomg needs nothing from prep
    finish_child(settings, view["steps"][1]["job_id"], JobState.succeeded, {"checkpoint": "/x"})
    view = get(client, token, pipeline["id"])
    assert [s["state"] for s in view["steps"]] == ["failed", "succeeded", "skipped", "skipped"]
    assert "needs the outputs of prep" in view["steps"][2]["reason"]
    assert view["state"] == "failed" and view["error"]["message"] == "steps failed: prep; skipped: train, tohf"


def test_cancel_stops_the_running_step_and_the_rest(client: TestClient, token: str, settings: Settings) -> None:
    pipeline = submit(client, token)
    first = pipeline["steps"][0]["job_id"]
    finish_child(settings, first, JobState.succeeded, {"data_path": "/d"})
    second = get(client, token, pipeline["id"])["steps"][1]["job_id"]
    with session_scope(settings.database_url) as session:  # the second step is running on a worker
        transition(session, second, JobState.starting, attempt_count=1)
        transition(session, second, JobState.running)
    cancelled = client.post(f"/v1/jobs/{pipeline['id']}/cancel", headers=auth(token))
    assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelling"
    assert get(client, token, second)["state"] == "cancelling"  # the worker now stops its processes
    recover(settings)  # the reconciler's cancel settling leaves a pipeline to its steps
    assert get(client, token, pipeline["id"])["state"] == "cancelling"
    with session_scope(settings.database_url) as session:
        transition(session, second, JobState.cancelled)
    pipelines.advance_parent(settings, second)
    view = get(client, token, pipeline["id"])
    assert view["state"] == "cancelled"
    assert [s["state"] for s in view["steps"]] == ["succeeded", "cancelled", "skipped", "skipped"]
    with session_scope(settings.database_url) as session:
        assert session.query(Job).filter(Job.parent_id == pipeline["id"]).count() == 2


def test_cancel_of_a_waiting_pipeline_cancels_its_queued_step(client: TestClient, token: str) -> None:
    pipeline = submit(client, token)
    response = client.post(f"/v1/jobs/{pipeline['id']}/cancel", headers=auth(token))
    assert response.json()["state"] == "cancelled"
    assert get(client, token, pipeline["steps"][0]["job_id"])["state"] == "cancelled"


def test_the_scheduler_never_runs_the_pipeline_row(client: TestClient, token: str, settings: Settings) -> None:
    from core.scheduler import schedule
    from worker.hosts import register_host

    pipeline = submit(client, token)
    register_host(settings, name="h", device_type="cpu", devices=4, queues=["host.h"])
    granted = {g.job_id for g in schedule(settings)}  # the Dispatcher's own pass may have granted the step already
    assert pipeline["id"] not in granted
    assert get(client, token, pipeline["steps"][0]["job_id"])["state"] == "starting"


@pytest.mark.parametrize(
    ("index", "field", "value", "text"),
    [
        (2, "steps.2.spec.load", "${steps.nope.outputs.checkpoint}", "unknown step 'nope'"),
        (2, "steps.2.spec.data_path", "${steps.tohf.outputs.checkpoint}", "does not run before step 'train'"),
        (2, "steps.2.spec.load", "${steps.train.outputs.checkpoint}", "does not run before step 'train'"),
        (3, "steps.3.spec.load_dir", "${steps.train.output.checkpoint}", "malformed reference"),
        (1, "steps.1.spec.save_dir", "../../etc", "must not contain '..'"),
    ],
)
def test_reference_errors_are_422_naming_the_field(
    client: TestClient, token: str, index: int, field: str, value: str, text: str
) -> None:
    body = steps()
    body[index]["spec"][field.rsplit(".", 1)[1]] = value
    response = client.post("/v1/jobs", json={"kind": "pipeline", "steps": body}, headers=auth(token))
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field and text in response.json()["message"]


def test_nested_spec_errors_name_the_step_field(client: TestClient, token: str) -> None:
    body = steps()
    body[2]["spec"]["global_batch_size"] = 3
    body[2]["spec"]["micro_batch_size"] = 2
    response = client.post("/v1/jobs", json={"kind": "pipeline", "steps": body}, headers=auth(token))
    assert response.status_code == 422
    assert response.json()["field"] == "steps.2.spec.global_batch_size"
    body = steps()
    body[1]["spec"]["kind"] = "pipeline"
    response = client.post("/v1/jobs", json={"kind": "pipeline", "steps": body}, headers=auth(token))
    assert response.status_code == 422 and response.json()["field"] == "steps.1.spec.kind"


def test_missing_output_at_run_time_fails_the_pipeline(client: TestClient, token: str, settings: Settings) -> None:
    pipeline = submit(client, token)
    finish_child(settings, pipeline["steps"][0]["job_id"], JobState.succeeded, {"output_prefix": "/d"})
    finish_child(
        settings, get(client, token, pipeline["id"])["steps"][1]["job_id"], JobState.succeeded, {"checkpoint": "/mg"}
    )
    view = get(client, token, pipeline["id"])
    assert view["state"] == "failed" and view["error"]["code"] == "step_invalid"
    assert "step prep has no output 'data_path' (its outputs: output_prefix)" in view["error"]["message"]
    assert [s["state"] for s in view["steps"]] == ["succeeded", "succeeded", "skipped", "skipped"]  # never pending
    assert view["steps"][2]["reason"].startswith("the pipeline failed: steps.2.spec: step prep has no output")


def test_a_step_no_host_could_run_is_422_naming_it(client: TestClient, token: str, settings: Settings) -> None:
    from worker.hosts import register_host

    register_host(settings, name="h", device_type="cpu", devices=2, queues=["host.h"])
    body = steps()
    body[2]["spec"]["resources"] = {"nproc_per_node": 4}
    response = client.post("/v1/jobs", json={"kind": "pipeline", "steps": body}, headers=auth(token))
    assert response.status_code == 422 and response.json()["code"] == "unschedulable"
    assert response.json()["field"] == "steps.2.spec.resources.nproc_per_node"
    assert response.json()["message"].startswith("steps.2.spec.resources.nproc_per_node: 4 cpu devices per node")
