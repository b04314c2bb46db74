"""Finding 4 at run time: a path swapped for a symlink after submission (to another team's area) is refused by the
engine right before it opens it (``engine.contract.guard``: the worker hands it the job's team areas), a ``bad_input`` naming
the field, and nothing is written into the other team's area."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.db import session_scope
from core.models import Job
from core.paths import team_area
from core.settings import Settings
from core_support import auth, make_token
from engine.cli import main as engine_main
from engine.contract.guard import READ_ENV, WRITE_ENV, check_spec
from engine.contract.spec import parse_spec
from worker.execute import write_spec
from worker.node import NodeWork, node_plan

BODY = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "out/x"}


def _submitted(client: TestClient, settings: Settings) -> tuple[NodeWork, Path]:
    """A job of team alpha accepted by the API, as its worker would launch it: (work, its run directory)."""
    answer = client.post("/v1/jobs", json=BODY, headers=auth(make_token(settings, "alpha")))
    assert answer.status_code == 201, answer.text
    with session_scope(settings.database_url) as session:
        job = session.get(Job, answer.json()["id"])
        assert job is not None
        work = NodeWork(1, job.id, 1, 0, 1, job.spec, Path(job.run_dir), [0], "127.0.0.1", 0, job.team)
    write_spec(work.run_dir, work.spec)
    return work, work.run_dir


def _run_engine(settings: Settings, work: NodeWork, monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    """``python -m engine`` in this process with the areas the worker's launch plan hands it; (exit code, error)."""
    env = node_plan(work, settings).env
    for name in (WRITE_ENV, READ_ENV):
        monkeypatch.setenv(name, env[name])
    code = engine_main(["preprocess", "--spec", str(work.run_dir / "spec.json"), "--run-dir", str(work.run_dir)])
    events = [json.loads(line) for line in (work.run_dir / "events.jsonl").read_text().splitlines()]
    return code, next(e for e in events if e["type"] == "error")


def test_an_output_swapped_for_a_symlink_is_refused_at_run_time(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, _ = _submitted(client, settings)
    env = node_plan(work, settings).env
    assert env[WRITE_ENV].split(":") == [str(team_area(settings, "alpha"))]
    monkeypatch.setenv(WRITE_ENV, env[WRITE_ENV])
    monkeypatch.setenv(READ_ENV, env[READ_ENV])
    check_spec(parse_spec(work.spec))  # as submitted: inside the area
    beta = team_area(settings, "beta")
    (team_area(settings, "alpha") / "out").symlink_to(beta)  # the swap, after submission
    code, error = _run_engine(settings, work, monkeypatch)
    assert code == 2 and error["data"] == {"code": "bad_input", "field": "output_prefix"}, error
    assert "outside this job's data area" in error["message"]
    assert sorted(p.name for p in beta.iterdir()) == ["in.jsonl", "tok"]  # nothing written there


def test_an_input_swapped_for_a_symlink_is_refused_at_run_time(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, _ = _submitted(client, settings)
    theirs = team_area(settings, "beta") / "in.jsonl"
    mine = team_area(settings, "alpha") / "in.jsonl"
    mine.unlink()
    mine.symlink_to(theirs)
    code, error = _run_engine(settings, work, monkeypatch)
    assert code == 2 and error["data"] == {"code": "bad_input", "field": "input"}, error


def test_a_symlink_inside_an_input_directory_is_refused(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, _ = _submitted(client, settings)
    shutil.rmtree(team_area(settings, "alpha") / "tok")
    (team_area(settings, "alpha") / "tok").mkdir()
    (team_area(settings, "alpha") / "tok" / "tokenizer.json").symlink_to(team_area(settings, "beta") / "in.jsonl")
    code, error = _run_engine(settings, work, monkeypatch)
    assert code == 2 and error["data"] == {"code": "bad_input", "field": "tokenizer_name_or_path"}, error
