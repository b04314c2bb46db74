"""Serve specs are validated like the others at submission: a ``model`` name no other live deployment of the team
answers to (409 naming the field), ``max_model_len`` within the model's positions (unless YaRN stretches them),
training fields refused with the serve field meant."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from core.db import session_scope
from core.models import Job
from core_support import auth, isolated_settings, make_token, team_dir


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    from app.main import create_app

    settings = isolated_settings(tmp_path)
    area = team_dir(settings, "alpha")
    (area / "base").mkdir()
    (area / "base" / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (area / "tok").mkdir()
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as client:
        client.app.state.test_settings = settings  # type: ignore[attr-defined]
        yield client


def serve(**extra: Any) -> dict[str, Any]:
    return {"kind": "serve", "load": "base", "tokenizer_name_or_path": "tok", **extra}


def test_a_served_name_is_unique_among_live_deployments(api: TestClient) -> None:
    first = api.post("/v1/jobs", json=serve(served_model_name="demo-chat"))
    assert first.status_code == 201, first.text
    again = api.post("/v1/jobs", json=serve(served_model_name="demo-chat"))
    by_name = api.post("/v1/jobs", json=serve(name="demo-chat"))
    as_adapter = api.post("/v1/jobs", json=serve(served_model_name="other", lora_adapters={"demo-chat": "base"}))
    other_team = api.post(
        "/v1/jobs",
        json=serve(load="/nowhere", served_model_name="demo-chat"),
        headers=auth(make_token(api.app.state.test_settings, "beta")),  # type: ignore[attr-defined]
    )
    for answer, field in ((again, "served_model_name"), (by_name, "name"), (as_adapter, "lora_adapters.demo-chat")):
        assert (answer.status_code, answer.json()["field"]) == (409, field), answer.text
        assert first.json()["id"] in answer.json()["message"]
    assert other_team.json().get("field") != "served_model_name"  # another team's names are its own
    with session_scope(api.app.state.test_settings.database_url) as session:  # type: ignore[attr-defined]
        session.execute(update(Job).where(Job.id == first.json()["id"]).values(state="cancelled"))
        session.commit()
    assert api.post("/v1/jobs", json=serve(served_model_name="demo-chat")).status_code == 201


def test_max_model_len_within_the_models_positions(api: TestClient) -> None:
    refused = api.post("/v1/jobs", json=serve(max_model_len=8192))
    assert (refused.status_code, refused.json()["field"]) == (422, "max_model_len"), refused.text
    assert "longer than the model's 2048 positions" in refused.json()["message"]
    yarn = {"rope_scaling_type": "yarn", "rope_scaling_factor": 4.0}
    stretched = api.post(
        "/v1/jobs", json=serve(max_model_len=8192, rope_scaling_original_max_position_embeddings=2048, **yarn)
    )
    assert stretched.status_code == 201, stretched.text
    assert api.post("/v1/jobs", json=serve(max_model_len=2048, served_model_name="b")).status_code == 201


@pytest.mark.parametrize(
    ("field", "meant"),
    [
        ("micro_batch_size", "max_num_seqs"),
        ("max_batch_size", "max_num_seqs"),
        ("seq_length", "max_model_len"),
        ("gpu_memory_utilization", "kv_cache_memory_fraction"),
    ],
)
def test_training_fields_are_refused_with_the_serve_field_meant(api: TestClient, field: str, meant: str) -> None:
    answer = api.post("/v1/jobs", json=serve(**{field: 8}))
    assert (answer.status_code, answer.json()["field"]) == (422, field), answer.text
    assert f"did you mean {meant!r}" in answer.json()["message"]


def test_training_only_fields_are_refused_by_the_spec_itself() -> None:
    from pydantic import ValidationError

    from engine.contract.spec import parse_spec

    with pytest.raises(ValidationError, match="hidden_dropout: a training field"):
        parse_spec(serve(hidden_dropout=0.1))


def _megatron_base(root: Path, positions: int) -> None:
    """A Megatron checkpoint with no config.json: its positions are only in the rank file's args."""
    import argparse
    import pickle
    import zipfile

    args = argparse.Namespace(
        num_layers=2, hidden_size=8, num_attention_heads=2, padded_vocab_size=16, max_position_embeddings=positions
    )
    rank = root / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    with zipfile.ZipFile(rank / "model_optim_rng.pt", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"args": args, "iteration": 1}, protocol=2))
        zf.writestr("archive/version", "3\n")


def test_max_model_len_within_a_megatron_bases_positions(api: TestClient) -> None:
    area = team_dir(api.app.state.test_settings, "alpha")  # type: ignore[attr-defined]
    _megatron_base(area / "mcore", 2048)
    refused = api.post("/v1/jobs", json=serve(load="mcore", max_model_len=4096))
    assert (refused.status_code, refused.json()["field"]) == (422, "max_model_len"), refused.text
    assert "2048 positions" in refused.json()["message"]
    accepted = api.post("/v1/jobs", json=serve(load="mcore", max_model_len=2048))
    assert accepted.status_code == 201, accepted.text
