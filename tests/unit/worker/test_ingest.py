"""Run files -> database rows: whole lines only, NaN-safe metrics, nothing ingested twice across attempts."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select

from core.db import session_scope
from core.models import Event, LogLine, MetricPoint
from core_support import isolated_settings, make_job
from engine.contract.runfiles import RunDir
from worker.ingest import FileTail, RunIngestor


def test_tail_keeps_an_unfinished_line_for_later(tmp_path: Path) -> None:
    path = tmp_path / "f.log"
    path.write_text("one\ntw")
    tail = FileTail(path)
    lines, tail.offset = tail.read_lines()
    assert lines == ["one"]
    with open(path, "a") as f:
        f.write("o\nthree")
    lines, tail.offset = tail.read_lines()
    assert lines == ["two"]
    assert tail.read_lines(final=True)[0] == ["three"]


def test_ingest_all_files_and_never_twice(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "var")
    job_id = make_job(settings)
    run = RunDir(tmp_path / "run")
    run.event("started", "go")
    run.metric(1, {"lm_loss": 2.5, "grad_norm": float("nan")}, {0: {"mem_allocated_mb": 12.0}})
    (run.path / "logs" / "rank0.log").write_text("hello\nworld\n")
    first = RunIngestor(settings.database_url, job_id, run.path, attempt=1)
    first.poll()  # nothing yet: the attempt starts after these lines were written
    with session_scope(settings.database_url) as session:
        assert session.scalars(select(Event).where(Event.type == "started")).all() == []

    second = RunIngestor(settings.database_url, job_id, run.path, attempt=2)
    run.event("error", "bad thing", code="engine_error")
    run.metric(2, {"lm_loss": 2.0})
    with open(run.path / "logs" / "rank0.log", "a") as f:
        f.write("again\n")
    (run.path / "logs" / "launcher.log").write_text("launcher line\n")
    counts = second.poll(final=True)
    assert counts == {"events": 1, "metrics": 1, "logs": 2}
    assert second.poll(final=True) == {"events": 0, "metrics": 0, "logs": 0}
    assert second.last_error is not None and second.last_error["message"] == "bad thing"
    with session_scope(settings.database_url) as session:
        events = session.scalars(select(Event).where(Event.type != "state")).all()
        assert [(e.type, e.level, e.attempt) for e in events] == [("error", "error", 2)]
        points = session.scalars(select(MetricPoint)).all()
        assert [(p.step, p.name, p.value, p.rank) for p in points] == [(2, "lm_loss", 2.0, None)]
        logs = session.scalars(select(LogLine).order_by(LogLine.stream, LogLine.seq)).all()
        assert [(line.stream, line.seq, line.text) for line in logs] == [
            ("launcher", 0, "launcher line"),
            ("rank0", 0, "again"),
        ]


def test_nan_becomes_null(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path / "var")
    job_id = make_job(settings)
    run_dir = tmp_path / "run"
    ingest = RunIngestor(settings.database_url, job_id, run_dir, attempt=1)
    RunDir(run_dir).metric(5, {"lm_loss": float("inf"), "lr": 1e-4}, {1: {"mem_allocated_mb": 3}})
    ingest.poll()
    with session_scope(settings.database_url) as session:
        rows = {(p.name, p.rank): p.value for p in session.scalars(select(MetricPoint))}
    assert rows == {("lm_loss", None): None, ("lr", None): 1e-4, ("mem_allocated_mb", 1): 3.0}
    assert json.loads((run_dir / "metrics.jsonl").read_text())["metrics"]["lm_loss"] == "inf"
