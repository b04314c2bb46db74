"""GET /v1/jobs/{id}/completions: a stage grpo run's completions.jsonl paged, by the rollout a step trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path)
    for team in ("alpha", "beta"):
        data = team_dir(settings, team)
        (data / "in.jsonl").write_text('{"text": "hi"}\n')
        (data / "tok").mkdir()
    return settings


def _row(iteration: int, i: int) -> dict:
    return {
        "iteration": iteration, "prompt_id": i // 4, "prompt_ids": [1, 2], "prompt": f"p{i // 4}", "completion_ids": [3, i],
        "completion": f"c{i}", "reward": float(i % 2), "rewards": {"exact_match": float(i % 2), "http": None if i == 7 else 0.5},  # null: a failed http batch
        "advantage": 0.5 - i % 2, "truncated": False,
    }  # fmt: skip


def test_completions_page_by_step(client: TestClient, settings: Settings) -> None:
    token = make_token(settings, "alpha")
    body = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "out/x"}
    job = client.post("/v1/jobs", json=body, headers=auth(token)).json()
    url = f"/v1/jobs/{job['id']}/completions"
    empty = client.get(url, headers=auth(token)).json()
    assert (empty["data"], empty["has_more"]) == ([], False)
    rows = [_row(it, i) for it in (1, 3) for i in range(8)]  # num_iterations 2: rollouts at iterations 1 and 3
    run = Path(job["run_dir"])
    run.mkdir(parents=True, exist_ok=True)
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = client.get(url, params={"step": 2, "limit": 5}, headers=auth(token)).json()
    assert first["data"] == rows[:5] and first["has_more"] and first["next_offset"] == 5
    rest = client.get(url, params={"step": 2, "limit": 5, "offset": 5}, headers=auth(token)).json()
    assert rest["data"] == rows[5:8] and not rest["has_more"]
    assert client.get(url, params={"step": 9}, headers=auth(token)).json()["data"] == rows[8:]
    every = client.get(url, params={"limit": 10, "offset": 10}, headers=auth(token)).json()
    assert every["data"] == rows[10:] and not every["has_more"]
    other = make_token(settings, "beta")
    assert client.get(url, headers=auth(other)).status_code == 404
    assert client.get(url, params={"step": 0}, headers=auth(token)).status_code in (400, 422)
