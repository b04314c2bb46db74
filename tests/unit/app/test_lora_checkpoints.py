"""A LoRA run's checkpoints say what they hold (read from their tensors by ``engine.contract.inspect``), each has its
own reference, and each is usable where a checkpoint is accepted: serve ``lora_adapters`` by reference or path, eval
``load`` by reference (the base taken from the run); a path to adapters alone in ``load`` is refused at submission
naming ``lora_load``, a full model as an adapter naming the adapter's field."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from core.db import session_scope
from core.settings import Settings
from core_support import auth, isolated_settings, make_job, make_token, set_job_spec, team_dir
from engine.contract import inspect

QKV = "decoder.layers.{}.self_attention.linear_qkv"


def _rank_file(root: Path, iteration: int, model: dict[str, torch.Tensor]) -> None:
    """A Megatron save as the engine's export writes it (tracker, iter_*/mp_rank_00/model_optim_rng.pt)."""
    rank = root / f"iter_{iteration:07d}" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save({"model": model, "iteration": iteration, "checkpoint_version": 3.0}, rank / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _adapters() -> dict[str, torch.Tensor]:
    return {f"{QKV.format(i)}.lora_{ab}.weight": torch.zeros(2, 2) for i in range(2) for ab in "AB"}


def test_inspector_reads_what_the_tensors_are(tmp_path: Path) -> None:
    _rank_file(tmp_path / "lora", 20, _adapters())
    _rank_file(tmp_path / "full", 20, {f"{QKV.format(0)}.weight": torch.zeros(2, 2)})
    _rank_file(tmp_path / "both", 20, {**_adapters(), "embedding.word_embeddings.weight": torch.zeros(2, 2)})
    assert inspect.contents(tmp_path / "lora") == inspect.Contents(lora=True, needs_base_model=True)
    assert inspect.contents(tmp_path / "full") == inspect.FULL
    assert inspect.contents(tmp_path / "both") == inspect.Contents(lora=True, needs_base_model=False)
    assert inspect.contents(tmp_path / "lora" / "iter_0000020") == inspect.Contents(True, True)
    assert inspect.contents(tmp_path / "absent") is None


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def test_a_lora_runs_checkpoints_are_usable_everywhere(settings: Settings) -> None:
    from app.main import create_app

    area = team_dir(settings, "alpha")
    (area / "base").mkdir()
    (area / "base" / "config.json").write_text("{}")
    (area / "base" / "tokenizer_config.json").write_text("{}")
    (area / "tok").mkdir()
    (area / "test.jsonl").write_text("{}\n")
    save = area / "lora-run"
    state = save / "train_state" / "iter_0000020"
    state.mkdir(parents=True)
    (state / "meta.json").write_text(json.dumps({"iteration": 20, "has_optimizer": True, "trainable_only": True}))
    _rank_file(save, 20, _adapters())  # the final export: adapters only
    _rank_file(area / "full-run", 20, {f"{QKV.format(0)}.weight": torch.zeros(2, 2)})
    job_id = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        spec = {"kind": "train", "save": str(save), "load": str(area / "base"), "lora_r": 2}
        set_job_spec(session, job_id, spec)
        session.commit()
    serve = {"kind": "serve", "load": "base", "tokenizer_name_or_path": "tok"}
    evaluate = {"kind": "eval", "tokenizer_name_or_path": "tok", "eval_data_path": "test.jsonl"}
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        listed = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
        answers = {
            "adapter_ref": api.post("/v1/jobs", json={**serve, "lora_adapters": {"x": listed[1]["reference"]}}),
            # each deployment answers to its own names (a live one's are refused)
            "adapter_readme_ref": api.post(
                "/v1/jobs", json={**serve, "lora_adapters": {"x2": {"job": job_id, "iteration": 20}}}
            ),
            "adapter_path": api.post("/v1/jobs", json={**serve, "lora_adapters": {"x3": "lora-run"}}),
            "adapter_full": api.post("/v1/jobs", json={**serve, "lora_adapters": {"x4": "full-run"}}),
            "eval_ref": api.post("/v1/jobs", json={**evaluate, "load": listed[1]["reference"]}),
            "eval_path": api.post("/v1/jobs", json={**evaluate, "load": "lora-run"}),
            "serve_path": api.post("/v1/jobs", json={**serve, "load": "lora-run"}),
        }
    assert [(c["format"], c["lora"], c["needs_base_model"], c["evaluable"]) for c in listed] == [
        ("training_state", True, True, True),
        ("mcore", True, True, True),
    ]
    assert listed[0]["reference"] != listed[1]["reference"]
    for name in ("adapter_ref", "adapter_readme_ref", "adapter_path", "eval_ref"):
        assert answers[name].status_code == 201, (name, answers[name].text)
    assert answers["adapter_ref"].json()["spec"]["lora_adapters"] == {"x": str(save)}
    stored = answers["eval_ref"].json()["spec"]
    assert (stored["load"], stored["lora_load"]) == (str(area / "base"), str(save))
    full = answers["adapter_full"].json()
    assert (answers["adapter_full"].status_code, full["field"]) == (422, "lora_adapters.x4")
    assert "full weights, not LoRA adapters" in full["message"]
    for name in ("eval_path", "serve_path"):
        body = answers[name].json()
        assert (answers[name].status_code, body["field"]) == (422, "load"), body
        assert "holds LoRA adapters only" in body["message"] and "lora_load" in body["message"]


DRAFT = """
const {CheckpointsPanel} = await import(process.argv[1]);
const job = JSON.parse(process.argv[2]);
console.log(JSON.stringify(CheckpointsPanel.prototype.draft.call({job}, "evaluate", {iteration: 20})));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the dashboard's module")
def test_the_dashboards_evaluate_draft_is_accepted(settings: Settings) -> None:
    """The checkpoint table's Evaluate button drafts a spec the API takes as it is (test set filled in): a LoRA
    run's checkpoint by reference, evaluated over the run's base."""
    from app.main import create_app

    area = team_dir(settings, "alpha")
    (area / "base").mkdir()
    (area / "base" / "config.json").write_text("{}")
    (area / "base" / "tokenizer_config.json").write_text("{}")
    (area / "test.jsonl").write_text("{}\n")
    save = area / "lora-run"
    _rank_file(save, 20, _adapters())
    spec = {"kind": "train", "save": str(save), "load": str(area / "base"), "lora_r": 2, "seq_length": 64}
    job_id = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        set_job_spec(session, job_id, spec)
        session.commit()
    panels = Path(__file__).resolve().parents[3] / "app" / "ui" / "js" / "views" / "panels.js"
    job = json.dumps({"id": job_id, "name": "lora", "spec": spec})
    out = subprocess.run(
        ["node", "--input-type=module", "-e", DRAFT, str(panels), job], capture_output=True, text=True, check=True
    )
    draft = {**json.loads(out.stdout), "eval_data_path": "test.jsonl"}
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        answer = api.post("/v1/jobs", json=draft)
    assert answer.status_code == 201, answer.text
    stored = answer.json()["spec"]
    assert (stored["load"], stored["lora_load"], stored["metadata"]["from_iteration"]) == (
        str(area / "base"),
        str(save),
        "20",
    )


def test_adapters_of_another_models_shape_are_refused(settings: Settings) -> None:
    """An adapter's recorded model shape (its rank file's args, read without torch) must be the base's."""
    import argparse

    from app.main import create_app
    from engine.contract.model_config import preset

    area = team_dir(settings, "alpha")
    tiny = preset("qwen3-tiny-tied")
    (area / "base").mkdir()
    (area / "base" / "config.json").write_text(json.dumps(tiny.to_hf()))
    (area / "base" / "tokenizer_config.json").write_text("{}")
    shape = {"num_layers": 2, "num_attention_heads": 4, "group_query_attention": True, "num_query_groups": 2}
    for name, hidden in (("same", tiny.hidden_size), ("wider", 2 * tiny.hidden_size)):
        args = argparse.Namespace(
            **shape, hidden_size=hidden, kv_channels=16, ffn_hidden_size=128, padded_vocab_size=256
        )
        rank = area / name / "iter_0000020" / "mp_rank_00"
        rank.mkdir(parents=True)
        torch.save({"args": args, "model": _adapters()}, rank / "model_optim_rng.pt")
        (area / name / "latest_checkpointed_iteration.txt").write_text("20")
    serve = {"kind": "serve", "load": "base"}
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        same = api.post("/v1/jobs", json={**serve, "lora_adapters": {"a": "same"}})
        wider = api.post("/v1/jobs", json={**serve, "lora_adapters": {"b": "wider"}})
    assert same.status_code == 201, same.text
    assert (wider.status_code, wider.json()["field"]) == (422, "lora_adapters.b"), wider.text
    assert "hidden_size 128 there, 64 in the base" in wider.json()["message"]
