"""The CLI's client commands against the in-process API: table, status, events, metrics, logs of one stream, wait's
exit code, and a 401 that names LLMJOBS_TOKEN."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from app.main import create_app
from cli import remote
from cli.main import cli
from core.db import session_scope
from core.jobs import transition
from core.models import Artifact, LogLine, MetricPoint
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, make_job, make_token, set_job_spec, team_dir
from llmjobs import Client


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


@pytest.fixture
def api(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as http:
        monkeypatch.setattr(remote, "Client", lambda: Client(http=http))
        yield http


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def finished_job(settings: Settings, state: JobState = JobState.succeeded) -> str:
    job_id = make_job(settings, team="alpha", name="demo")
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(MetricPoint),
            [
                {"job_id": job_id, "step": s, "name": f"m{i}", "value": float(s), "rank": None}
                for s in (1, 2)
                for i in range(3)
            ],
        )
        session.execute(
            insert(LogLine),
            [
                {"job_id": job_id, "stream": st, "seq": i, "text": f"{st} line {i}"}
                for st in ("launcher", "rank0", "rank1")
                for i in range(2)
            ],
        )
        session.commit()
        result = {"kind": "preprocess", "outputs": {}, "summary": {}} if state is JobState.succeeded else None
        assert _start(session, job_id) and transition(session, job_id, state, result=result)
    return job_id


def _start(session: Session, job_id: str) -> bool:
    return transition(session, job_id, JobState.starting) and transition(session, job_id, JobState.running)


def test_list_is_a_table_and_json(api: TestClient, settings: Settings) -> None:
    job_id = finished_job(settings)
    code, out = run("list")
    assert code == 0, out
    header, row = out.splitlines()[:2]
    assert header.split() == ["ID", "NAME", "STATE", "KIND", "AGE", "PROGRESS"]
    assert row.split()[:4] == [job_id, "demo", "succeeded", "preprocess"]
    code, out = run("list", "--json")
    assert json.loads(out)["data"][0]["id"] == job_id


def test_status_events_metrics_logs(api: TestClient, settings: Settings) -> None:
    job_id = finished_job(settings)
    code, out = run("status", job_id)
    assert code == 0 and "state:" in out and "succeeded" in out, out
    assert json.loads(run("status", job_id, "--json")[1])["id"] == job_id
    code, out = run("events", job_id, "--type", "state")
    assert [line.split()[2] for line in out.splitlines()] == ["queued", "starting", "running", "succeeded"], out
    code, out = run("metrics", job_id)
    assert len(out.splitlines()) == 6
    assert run("logs", job_id)[1].splitlines() == ["rank0 line 0", "rank0 line 1"]
    assert run("logs", job_id, "--rank", "1")[1].splitlines() == ["rank1 line 0", "rank1 line 1"]
    assert run("logs", job_id, "--all")[1].splitlines() == ["launcher line 0", "launcher line 1"]
    code, out = run("logs", job_id, "--follow")
    assert [line for line in out.splitlines() if "line" in line] == ["rank0 line 0", "rank0 line 1"], out


@pytest.mark.parametrize(("state", "code"), [(JobState.succeeded, 0), (JobState.failed, 1), (JobState.cancelled, 3)])
def test_wait_exits_with_the_outcome(api: TestClient, settings: Settings, state: JobState, code: int) -> None:
    job_id = finished_job(settings) if state is JobState.succeeded else make_job(settings, team="alpha")
    if state is JobState.failed:
        with session_scope(settings.database_url) as session:
            assert _start(session, job_id) and transition(session, job_id, state)
    elif state is JobState.cancelled:
        with session_scope(settings.database_url) as session:
            assert transition(session, job_id, state)
    assert run("wait", job_id)[0] == code


def test_a_401_names_llmjobs_token(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(create_app(settings, reconcile=False), headers=auth("llmj_wrong")) as http:
        monkeypatch.setattr(remote, "Client", lambda: Client(http=http))
        code, out = run("list")
    assert code == 1 and "LLMJOBS_TOKEN" in out and "401" in out


def test_delete_a_finished_job_not_a_running_one(api: TestClient, settings: Settings) -> None:
    job_id = finished_job(settings)
    run_dir = settings.runs_path / job_id
    (run_dir / "logs").mkdir(parents=True)
    output = team_dir(settings, "alpha") / "out" / "model"
    output.mkdir(parents=True)
    (output / "w.bin").write_bytes(b"1")
    outside = settings.var_dir / "keep.txt"
    outside.write_text("x")
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(Artifact),
            [
                {
                    "job_id": job_id,
                    "name": "checkpoint",
                    "path": str(output),
                    "files": [str(output / "w.bin"), str(outside)],
                    "size_bytes": 1,
                }
            ],
        )
        session.commit()
    running = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        assert _start(session, running)
    refused = api.delete(f"/v1/jobs/{running}")
    assert refused.status_code == 409 and refused.json()["code"] == "job_active"
    code, out = run("delete", job_id, "--outputs")
    assert code == 0 and f"removed {output}" in out, out
    assert not run_dir.exists() and not output.exists() and outside.exists()  # never outside the roots
    assert api.get(f"/v1/jobs/{job_id}").status_code == 404
    assert api.get(f"/v1/jobs/{job_id}/events").status_code == 404
    assert api.get(f"/v1/jobs/{running}").status_code == 200


def test_issue_27_cli_details(api: TestClient, settings: Settings, tmp_path: Path) -> None:
    """wait's result on stdout; list's train progress in iterations; metrics of a job without points says so; an
    upload conflict names the --overwrite flag, not the API's query parameter."""
    done = finished_job(settings)
    waited = CliRunner().invoke(cli, ["wait", done])
    assert waited.exit_code == 0 and waited.stdout == f"{done} succeeded\n"

    train = make_job(settings, team="alpha", name="sweep")
    with session_scope(settings.database_url) as session:
        spec = {"kind": "train", "train_iters": 20}
        set_job_spec(session, train, spec)
        rows = [{"job_id": train, "step": s, "name": "tokens", "value": 64.0, "rank": None} for s in (1, 2, 3)]
        session.execute(insert(MetricPoint), rows)
        session.commit()
    listed = [line for line in run("list")[1].splitlines() if line.startswith(train)]
    assert listed and listed[0].endswith("3/20 iterations"), listed

    empty = CliRunner().invoke(cli, ["metrics", make_job(settings, team="alpha")])
    assert empty.exit_code == 0 and empty.stdout == "" and "has no metric points" in empty.stderr

    local = tmp_path / "mine.jsonl"
    local.write_text('{"text": "hi"}\n')
    assert run("upload", str(local))[0] == 0
    code, out = run("upload", str(local))
    assert code == 1 and "run again with --overwrite" in out and "overwrite=true" not in out, out
    assert run("upload", str(local), "--overwrite")[0] == 0


def test_following_a_pipeline_shows_each_steps_loss_and_logs(
    api: TestClient, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """The parent's stream names each step's job as it is submitted; the CLI follows that job's stream (its metric
    points and rank-0 log lines, prefixed with the step's name) and then resumes the parent's where it left it."""
    from core.jobs import add_event

    parent = make_job(settings, team="alpha", name="chain")
    child = finished_job(settings)
    with session_scope(settings.database_url) as session:
        add_event(
            session, parent, "step", f"step tune submitted as job {child}", data={"step": "tune", "job_id": child}
        )
        session.commit()
        assert _start(session, parent)
        add_event(session, parent, "step", "the last step ended")
        assert transition(session, parent, JobState.succeeded, result={"kind": "pipeline", "outputs": {}})
    remote._follow(parent)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[tune] rank0 line 0", "[tune] rank0 line 1"], out
    lines = err.splitlines()
    metrics = [line for line in lines if line.startswith("[tune] [metric] step")]
    assert len(metrics) == 2 and "'m0': 1.0" in metrics[0], err
    tune_end = lines.index(f"[tune] {child} succeeded")
    assert lines.index("[event] step: the last step ended") > tune_end  # the parent resumed after the step
    assert lines[-1] == f"{parent} succeeded" and err.count("submitted as job") == 1, err
