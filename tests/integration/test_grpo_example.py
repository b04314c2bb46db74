"""examples/10-grpo.json over the API on a real worker: preprocess -> SFT -> GRPO (exact_match and the overlong
penalty, beta 0.04) -> HF -> eval on the demo data; the GRPO step reports TRL's metric names and keeps every
completion in its run directory's completions.jsonl."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings
from demo_fixtures import demo_client, demo_settings
from sched_support import log_text, start_worker, stop_worker, wait_terminal

# the GRPO example trains with generation on a worker: 94 s under CI load
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "10-grpo.json"
TRL_NAMES = (
    "reward",
    "reward_std",
    "rewards/exact_match/mean",
    "rewards/length/std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return demo_settings(tmp_path)


@pytest.fixture
def api(settings: Settings) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with demo_client(settings) as client:
        yield client


def test_the_grpo_example_runs_and_keeps_its_completions(
    settings: Settings, tmp_path: Path, api: tuple[TestClient, dict[str, str]]
) -> None:
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import Job

    client, headers = api
    worker = start_worker(settings, "demo-host", 1, tmp_path / "worker.log")
    try:
        answer = client.post("/v1/jobs", json=json.loads(EXAMPLE.read_text()), headers=headers)
        assert answer.status_code == 201, answer.text
        job = wait_terminal(settings, answer.json()["id"], 600)
        assert job.state == "succeeded", (job.error, log_text(settings, job.id))
    finally:
        stop_worker(worker)
    with session_scope(settings.database_url) as session:
        grpo = session.scalars(select(Job).where(Job.parent_id == job.id, Job.name.endswith("/grpo"))).one()
        grpo_id = grpo.id
    points = client.get(f"/v1/jobs/{grpo_id}/metrics", params={"limit": 10000}, headers=headers).json()["data"]
    names = {p["name"] for p in points if p["rank"] is None}
    assert set(TRL_NAMES) <= names, sorted(set(TRL_NAMES) - names)
    spec = json.loads(EXAMPLE.read_text())["steps"][2]["spec"]
    rows = [json.loads(line) for line in (settings.runs_dir / grpo_id / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == spec["train_iters"] * spec["global_batch_size"]
    for row in rows:
        assert set(row) == {
            "iteration", "prompt_id", "prompt_ids", "prompt", "completion_ids", "completion", "reward", "rewards",
            "advantage", "truncated",
        }  # fmt: skip
        assert 1 <= len(row["completion_ids"]) <= spec["max_completion_length"]
        assert set(row["rewards"]) == {"exact_match", "length"}
