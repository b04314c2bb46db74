"""A database outage seen from a worker: the ingestor keeps what it could not store in the run files and catches up
(nothing lost, nothing twice), the watch keeps the engine running, and the outcome is stored once the database is
back, within a deadline; errors the database answered propagate at once. The database is made to fail by a flaky sink
or a patched call (tests/integration/test_outages.py and test_worker_db_outage.py stop a real PostgreSQL)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from core.db import is_database_away, session_scope
from core.jobs import transition
from core.models import Job
from core.states import JobState
from core_support import isolated_settings, make_job
from engine.contract.runfiles import RunDir
from worker import ingest, node
from worker.ingest import Batch, RunIngestor


def away() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))


class _Refused(Exception):
    """A driver error carrying a server's SQLSTATE, as psycopg's do."""

    def __init__(self, message: str, sqlstate: str):
        super().__init__(message)
        self.sqlstate = sqlstate


class FlakySink:
    """Refuses the first ``outage`` batches, as a database that is away does, then stores them."""

    def __init__(self, outage: int):
        self.outage, self.calls = outage, 0
        self.metrics: list[dict[str, object]] = []
        self.logs: list[tuple[str, str]] = []
        self.events: list[dict[str, object]] = []

    def __call__(self, batch: Batch) -> None:
        self.calls += 1
        if self.calls <= self.outage:
            raise away()
        self.metrics += batch.metrics
        self.logs += batch.logs
        self.events += batch.events


def test_ingest_keeps_lines_in_the_run_files_while_the_sink_fails_and_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "MAX_BYTES_PER_POLL", 1024)  # ~10 metric lines a batch: the backlog spans many
    run = RunDir(tmp_path / "run")
    sink = FlakySink(outage=3)
    ingestor = RunIngestor("unused://", "j", run.path, attempt=1, sink=sink)
    steps = 400
    for step in range(1, steps):  # the engine goes on writing while nothing can be stored
        run.metric(step, {"lm_loss": 10.0 - step / 100})
        with open(run.path / "logs" / "rank0.log", "a") as f:
            f.write(f"step {step}\n")
        if step % 100 == 0:
            with pytest.raises(OperationalError):
                ingestor.poll()
            assert ingestor.away_since is not None
    run.event("done", "finished")
    polls = 0
    while any(ingestor.poll().values()):
        polls += 1
        assert polls < 20
    assert ingestor.away_since is None
    assert [int(str(m["step"])) for m in sink.metrics] == list(range(1, steps))  # each step once, in order
    assert sink.logs == [("rank0", f"step {step}") for step in range(1, steps)]
    assert [e["type"] for e in sink.events] == ["done"]
    backlog_batches = (run.path / "metrics.jsonl").stat().st_size // 1024
    assert polls <= backlog_batches // ingest.CATCH_UP_BATCHES + 2  # many batches a poll, not one


def test_the_final_poll_stores_the_whole_backlog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "MAX_BYTES_PER_POLL", 1024)
    run = RunDir(tmp_path / "run")
    sink = FlakySink(outage=1)
    ingestor = RunIngestor("unused://", "j", run.path, attempt=1, sink=sink)
    for step in range(300):
        run.metric(step, {"lm_loss": 1.0})
    with pytest.raises(OperationalError):
        ingestor.poll(final=True)
    assert ingestor.poll(final=True)["metrics"] == 300
    assert [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()] == [
        m["step"] for m in sink.metrics
    ]


class FakeEngine:
    """An engine that runs for ``polls`` watch rounds, then exits 0."""

    def __init__(self, polls: int):
        self.left, self.terminated = polls, False

    def poll(self) -> int | None:
        self.left -= 1
        return None if self.left > 0 else 0

    def terminate(self, grace_s: float) -> int:
        self.terminated = True
        return -15


def test_the_engine_keeps_running_while_the_database_is_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = isolated_settings(tmp_path / "var", ingest_interval_s=0.01, heartbeat_interval_s=60)
    job_id = make_job(settings)
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.starting, attempt_count=1)
        assert transition(session, job_id, JobState.running)
    work = node.NodeWork(0, job_id, 1, 0, 1, {}, tmp_path / "run", [], "127.0.0.1", 0)
    real, calls = node._job_view, []

    def job_view(settings_: object, work_: node.NodeWork, beat: bool) -> tuple[str, int]:
        calls.append(beat)
        if len(calls) <= 5:
            raise away()
        return real(settings, work_, beat)

    monkeypatch.setattr(node, "_job_view", job_view)
    engine = FakeEngine(polls=10)
    assert node.watch_node(settings, work, engine, None) == (0, None)  # type: ignore[arg-type]
    assert not engine.terminated
    assert calls[5] is True  # the first answer after the outage carries a heartbeat
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.heartbeat_at is not None


def test_the_outcome_is_stored_once_the_database_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(node.time, "sleep", slept.append)
    tries = iter([away(), away(), away(), "succeeded"])

    def settle() -> str:
        outcome = next(tries)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert node.until_stored("job j: outcome", settle, time.monotonic() + 60, max_delay_s=1.0) == "succeeded"
    assert slept == [0.5, 1.0, 1.0]


def _raises(err: Exception) -> Callable[[], None]:
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        raise err

    step.calls = calls  # type: ignore[attr-defined]
    return step


@pytest.mark.parametrize(
    "err",
    [
        IntegrityError("INSERT", {}, ValueError("duplicate key")),
        ProgrammingError("SELECT", {}, ValueError("syntax error")),
        ValueError("not a database error"),
        OperationalError("UPDATE", {}, _Refused("deadlock detected", "40P01")),  # refused, not away
    ],
)
def test_errors_the_database_answered_propagate_at_once(err: Exception) -> None:
    step = _raises(err)
    with pytest.raises(type(err)):
        node.until_stored("x", step, time.monotonic() + 60)
    assert step.calls == [1]  # type: ignore[attr-defined]


def test_past_the_deadline_the_wait_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(node.time, "sleep", slept.append)
    step = _raises(away())
    with pytest.raises(node.DatabaseStillAway, match="the database stayed away"):
        node.until_stored("x", step, time.monotonic() - 1)  # the deadline has passed: one try, no wait
    assert step.calls == [1] and slept == []  # type: ignore[attr-defined]


def test_which_errors_mean_the_database_is_away(tmp_path: Path) -> None:
    assert is_database_away(away())
    assert is_database_away(OperationalError("SELECT 1", {}, _Refused("terminating connection", "57P01")))
    assert is_database_away(OperationalError("SELECT 1", {}, _Refused("connection failure", "08006")))
    assert not is_database_away(OperationalError("SELECT 1", {}, _Refused("canceling statement", "57014")))
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(OperationalError) as missing, engine.connect() as connection:
        connection.execute(sa.text("SELECT * FROM no_such_table"))
    assert not is_database_away(missing.value)  # SQLite answered: a programming error under OperationalError
    locked = sqlite3.OperationalError("database is locked")
    locked.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
    assert is_database_away(OperationalError("UPDATE", {}, locked))
    engine.dispose()
