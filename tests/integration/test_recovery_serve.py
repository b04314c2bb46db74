"""A serve job's engine SIGKILLed under a real worker: the attempt ends as a signal death (retryable), the job gets
a new attempt, and the deployment is ready again: a new ``ready`` event of attempt 2 with a URL that answers the
same greedy tokens (the dead attempt's URL is never handed out again)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import select

from core.auth import Principal
from core.db import session_scope
from core.deployments import find_deployment
from core.models import Event, Job, JobNode
from core_support import isolated_settings, team_dir
from sched_support import job_processes, log_text, reconciler, running_worker, submit, wait_for
from tests.convert_tiny import real_vocab_qwen3

pytestmark = pytest.mark.slow
PROMPT = {"prompt_token_ids": [9707, 11, 1879, 0], "max_tokens": 6, "temperature": 0}


def _ready_url(settings, job_id: str, attempt: int) -> str | None:
    """The URL the API would route to, once attempt ``attempt`` is the job's current one and reported ready."""
    with session_scope(settings.database_url) as session:
        dep = find_deployment(session, Principal(team="t", admin=False, token_id=0), job_id)
        current = session.get(Job, job_id)
        return dep.url if dep is not None and current is not None and current.attempt_count == attempt else None


def _tokens(url: str) -> list[int]:
    with httpx.stream("POST", f"{url}/v1/generate", json=PROMPT, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [json.loads(x) for x in r.iter_lines() if x]
    return [x["token_id"] for x in lines if x["type"] == "token" and x["token_id"] is not None]


def test_killed_engine_is_restarted_and_ready_again(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    # no retry backoff (tests/unit/core/test_retry_backoff.py): the default 10 s was waited out before attempt 2
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3, retry_backoff_s=0)
    area = team_dir(settings, "t") / "serve"
    shutil.copytree(qwen_tokenizer_dir, area / "tok")
    torch.manual_seed(3)
    real_vocab_qwen3(area / "hf", initializer_range=0.5)
    spec = {
        "kind": "serve",
        "load": str(area / "hf"),
        "tokenizer_name_or_path": str(area / "tok"),
        "max_num_seqs": 2,
        "max_model_len": 64,
        "max_restarts": 1,
    }
    with running_worker(settings, "h1", 1, tmp_path / "h1.log"), reconciler(settings):
        job_id = submit(settings, spec)
        wait_for(settings, job_id, lambda _: _ready_url(settings, job_id, 1), 180, "ready (attempt 1)")
        first_url = _ready_url(settings, job_id, 1)
        assert first_url is not None
        before = _tokens(first_url)
        for pid in job_processes(job_id):
            os.kill(pid, signal.SIGKILL)
        row = wait_for(settings, job_id, lambda _: _ready_url(settings, job_id, 2), 180, "ready again (attempt 2)")
        second_url = _ready_url(settings, job_id, 2)
        assert second_url is not None and second_url != first_url
        assert _tokens(second_url) == before, log_text(settings, job_id)
        assert row.state == "running" and row.attempt_count == 2
        with session_scope(settings.database_url) as session:
            first = session.scalars(select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == 1)).one()
            retry = session.scalar(select(Event.message).where(Event.job_id == job_id, Event.message.like("retrying%")))
        assert first.exit_code is not None and first.exit_code < 0, first.exit_code  # a signal death
        assert retry is not None and "(1 of 2 attempts used)" in retry
