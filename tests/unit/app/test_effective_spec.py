"""GET /v1/jobs/{id}/effective-spec: each field's value from the spec model the API validates with — set, read from
the loaded checkpoint (a serve job's too), what the engine builds (Qwen3: RMSNorm, RoPE, SwiGLU, not Megatron's
LayerNorm / learned_absolute / swiglu false), else the model's default."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from core_support import auth, isolated_settings, make_token, team_dir
from engine.contract.model_config import preset


def test_a_qwen3_jobs_spec_tab_shows_what_it_runs_with(tmp_path: Path) -> None:
    from app.main import create_app

    settings = isolated_settings(tmp_path)
    area = team_dir(settings, "alpha")
    (area / "tiny").mkdir()
    (area / "tiny" / "config.json").write_text(json.dumps(preset("qwen3-tiny-tied").to_hf()))
    (area / "tiny" / "tokenizer_config.json").write_text("{}")
    serve = {"kind": "serve", "load": "tiny", "max_num_seqs": 4}
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        job = api.post("/v1/jobs", json=serve)
        assert job.status_code == 201, job.text
        rows = api.get(f"/v1/jobs/{job.json()['id']}/effective-spec").json()["data"]
        other = api.get(
            f"/v1/jobs/{job.json()['id']}/effective-spec", headers=auth(make_token(settings, "beta"))
        ).status_code
    got = {r["field"]: (r["value"], r["source"]) for r in rows}
    assert got["max_num_seqs"] == (4, "set")
    assert got["max_model_len"] == (2048, "default")
    assert got["hidden_size"] == (64, "checkpoint") and got["num_layers"] == (2, "checkpoint")
    assert got["max_position_embeddings"] == (2048, "checkpoint")
    assert got["rotary_base"][1] == "checkpoint"
    assert got["normalization"] == ("RMSNorm", "engine")
    assert got["swiglu"] == (True, "engine") and got["position_embedding_type"] == ("rope", "engine")
    assert other == 404
