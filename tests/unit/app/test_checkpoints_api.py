"""GET /v1/jobs/{id}/checkpoints: a train job's save directory as checkpoint objects with the loss at each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert

from core.db import session_scope
from core.models import MetricPoint
from core.settings import Settings
from core_support import auth, isolated_settings, make_job, make_token, set_job_spec, team_dir


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def test_checkpoints_of_a_train_job(settings: Settings) -> None:
    from app.main import create_app

    save = team_dir(settings, "alpha") / "ckpt"
    for it, optimizer in ((10, True), (20, False)):
        state = save / "train_state" / f"iter_{it:07d}"
        state.mkdir(parents=True)
        (state / "meta.json").write_text(json.dumps({"iteration": it, "has_optimizer": optimizer}))
        (state / ".metadata").write_bytes(b"")  # a DCP checkpoint's index: what submission looks for
    (save / "train_state" / "iter_0000030.tmp").mkdir()  # an unfinished save
    (save / "iter_0000020" / "mp_rank_00").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    job_id = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        set_job_spec(session, job_id, {"kind": "train", "save": str(save)})
        session.execute(
            insert(MetricPoint),
            [
                {"job_id": job_id, "step": s, "name": n, "value": v, "rank": r}
                for s, n, v, r in [
                    (10, "lm_loss", 2.5, None),
                    (10, "val_lm_loss", 2.7, None),
                    (20, "lm_loss", 1.5, None),
                    (20, "lm_loss", 9.0, 0),
                    (15, "lm_loss", 2.0, None),
                ]
            ],
        )
        session.commit()
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        data = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
        other = api.get(f"/v1/jobs/{job_id}/checkpoints", headers=auth(make_token(settings, "beta")))
        (team_dir(settings, "alpha") / "tok").mkdir()
        (team_dir(settings, "alpha") / "test.jsonl").write_text("{}\n")
        evaluate = {
            "kind": "eval",
            "load": {"job": job_id, "iteration": 20},
            "tokenizer_name_or_path": "tok",
            "eval_data_path": "test.jsonl",
        }
        accepted = api.post("/v1/jobs", json=evaluate)
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["spec"]["load"] == str(save)  # the final export
        convert = {
            "kind": "convert",
            "load_model_type": "mg",
            "save_model_type": "hf",
            "save_dir": "out/hf",
            "load_dir": {"job": job_id, "iteration": 10},
        }
        accepted = api.post("/v1/jobs", json=convert)
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["spec"]["load_dir"] == str(save / "train_state" / "iter_0000010")
        missing = api.post("/v1/jobs", json={**evaluate, "load": {"job": job_id, "iteration": 99}})
        assert missing.status_code == 422 and missing.json()["field"] == "load.iteration", missing.text
        assert "10, 20" in missing.json()["message"]
        hidden = api.post("/v1/jobs", json=evaluate, headers=auth(make_token(settings, "beta")))
        unknown = api.post("/v1/jobs", json={**evaluate, "load": {"job": "job_nope", "iteration": 20}})
        for answer in (hidden, unknown):  # another team's job reads as unknown: the same 422 on the field
            assert answer.status_code == 422 and answer.json()["field"] == "load.job", answer.text
        assert hidden.json()["message"] == f"load.job: no job {job_id}"
        eval_job = make_job(settings, team="alpha")
        not_train = api.post("/v1/jobs", json={**convert, "load_dir": {"job": eval_job, "iteration": 1}})
        assert not_train.status_code == 422 and not_train.json()["field"] == "load_dir.job", not_train.text
        for bad in ({"job": job_id}, {"job": job_id, "iteration": "20"}, {"job": job_id, "iteration": True}):
            shape = api.post("/v1/jobs", json={**evaluate, "load": bad})
            assert shape.status_code == 422 and shape.json()["field"] == "load", shape.text
        in_pipeline = api.post(
            "/v1/jobs",
            json={
                "kind": "pipeline",
                "steps": [{"name": "ev", "spec": {**evaluate, "load": {"job": job_id, "iteration": 7}}}],
            },
        )
        assert in_pipeline.status_code == 422 and in_pipeline.json()["field"] == "steps.0.spec.load.iteration"
        from typer.testing import CliRunner

        from cli import remote
        from cli.main import cli
        from llmjobs import Client

        remote_client = remote.Client
        remote.Client = lambda: Client(http=api)  # type: ignore[assignment,misc]
        try:
            table = CliRunner().invoke(cli, ["checkpoints", job_id]).output.splitlines()
        finally:
            remote.Client = remote_client  # type: ignore[misc]
        assert table[0].split() == ["ITERATION", "FORMAT", "LM_LOSS", "VAL_LM_LOSS", "LORA", "PATH"]
        assert table[1].split()[:4] == ["10", "training_state", "2.5000", "2.7000"]
    assert [(c["iteration"], c["format"]) for c in data] == [
        (10, "training_state"),
        (20, "training_state"),
        (20, "mcore"),
    ]
    assert data[0]["metrics"] == {"lm_loss": 2.5, "val_lm_loss": 2.7} and data[2]["metrics"] == {"lm_loss": 1.5}
    assert data[0]["optimizer_path"] == data[0]["model_path"] and data[1]["optimizer_path"] is None
    assert data[2]["model_path"] == str(save)
    assert data[2]["reference"] == {"job": job_id, "iteration": 20, "format": "mcore"}
    assert data[1]["reference"] == {"job": job_id, "iteration": 20, "format": "training_state"}
    assert other.status_code == 404


def test_serve_adapters_by_reference(settings: Settings) -> None:
    """A serve job's ``lora_adapters`` may name a LoRA train job's checkpoint by reference (its path is stored); a
    full-weights checkpoint is refused naming the adapter's field."""
    from app.main import create_app

    area = team_dir(settings, "alpha")
    save = area / "lora-run"
    state = save / "train_state" / "iter_0000010"
    state.mkdir(parents=True)
    (state / "meta.json").write_text(json.dumps({"iteration": 10, "has_optimizer": True, "trainable_only": True}))
    full = area / "full-run" / "train_state" / "iter_0000010"
    full.mkdir(parents=True)
    (full / "meta.json").write_text(json.dumps({"iteration": 10, "has_optimizer": True}))
    jobs = {}
    for name, root in (("lora", save), ("full", area / "full-run")):
        jobs[name] = make_job(settings, team="alpha")
        with session_scope(settings.database_url) as session:
            spec = {"kind": "train", "save": str(root), "load": str(area / "base")}
            set_job_spec(session, jobs[name], spec)
            session.commit()
    (area / "base").mkdir()
    (area / "base" / "config.json").write_text("{}")
    (area / "tok").mkdir()
    serve = {"kind": "serve", "load": "base", "tokenizer_name_or_path": "tok"}
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        accepted = api.post(
            "/v1/jobs", json={**serve, "lora_adapters": {"sql-lora": {"job": jobs["lora"], "iteration": 10}}}
        )
        refused = api.post(
            "/v1/jobs", json={**serve, "lora_adapters": {"sql-lora": {"job": jobs["full"], "iteration": 10}}}
        )
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["spec"]["lora_adapters"] == {"sql-lora": str(state)}
    assert refused.status_code == 422 and refused.json()["field"] == "lora_adapters.sql-lora", refused.text
    assert "full weights" in refused.json()["message"]
