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
from grpo_example_support import EXAMPLE, assert_grpo_step_reported
from sched_support import log_text, start_worker, stop_worker, wait_terminal

# the GRPO example trains with generation on a worker: 94 s under CI load
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


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
    client, headers = api
    worker = start_worker(settings, "demo-host", 1, tmp_path / "worker.log")
    try:
        answer = client.post("/v1/jobs", json=json.loads(EXAMPLE.read_text()), headers=headers)
        assert answer.status_code == 201, answer.text
        job = wait_terminal(settings, answer.json()["id"], 600)
        assert job.state == "succeeded", (job.error, log_text(settings, job.id))
    finally:
        stop_worker(worker)
    assert_grpo_step_reported(settings, client, headers, job.id)
