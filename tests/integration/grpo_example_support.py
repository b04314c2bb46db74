"""What examples/10-grpo.json's GRPO step must leave behind (not a test module): TRL's metric names over the API and
every completion in its run directory's completions.jsonl. Shared so that the one run of the example in
``test_examples.test_every_example_succeeds_in_order`` can assert it, instead of a second run of the whole pipeline."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from core.settings import Settings

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


def assert_grpo_step_reported(
    settings: Settings, client: TestClient, headers: dict[str, str], pipeline_id: str
) -> None:
    """The succeeded pipeline ``pipeline_id`` of examples/10-grpo.json: its GRPO step reports TRL's metric names and
    kept one well-formed completion row per generated completion."""
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import Job

    with session_scope(settings.database_url) as session:
        grpo_id = session.scalars(select(Job.id).where(Job.parent_id == pipeline_id, Job.name.endswith("/grpo"))).one()
    points = client.get(f"/v1/jobs/{grpo_id}/metrics", params={"limit": 10000}, headers=headers).json()["data"]
    names = {p["name"] for p in points if p["rank"] is None}
    assert set(TRL_NAMES) <= names, sorted(set(TRL_NAMES) - names)
    spec = json.loads(EXAMPLE.read_text())["steps"][2]["spec"]
    assert spec["stage"] == "grpo"
    rows = [json.loads(line) for line in (settings.runs_dir / grpo_id / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == spec["train_iters"] * spec["global_batch_size"]
    for row in rows:
        assert set(row) == {
            "iteration", "prompt_id", "prompt_ids", "prompt", "completion_ids", "completion", "reward", "rewards",
            "advantage", "truncated",
        }  # fmt: skip
        assert 1 <= len(row["completion_ids"]) <= spec["max_completion_length"]
        assert set(row["rewards"]) == {"exact_match", "length"}
