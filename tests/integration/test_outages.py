"""Outages: the API on a private PostgreSQL that is stopped mid-run answers 503 with the error shape, /readyz says
so, and both recover without a restart once the database is back (the SDK's read, sent again after each 503, gets
its answer); nothing committed before is lost. A worker's
watch over a running engine keeps it running through the outage and its ingestor catches up (every metric point and
log line once). Two workers starting at the same moment on the embedded broker both come up."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.main import create_app
from core.db import session_scope
from core.jobs import transition
from core.models import Host, LogLine, MetricPoint
from core.states import JobState
from core_support import auth, isolated_settings, make_job, make_token, team_dir
from engine.contract.runfiles import RunDir
from llmjobs import Client
from outage_support import private_postgres
from sched_support import start_worker, stop_worker
from worker.ingest import RunIngestor
from worker.node import NodeWork, until_stored, watch_node

pytestmark = pytest.mark.slow
BODY = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"}


@pytest.mark.postgres
def test_api_answers_503_while_the_database_is_away_and_recovers(tmp_path: Path) -> None:
    with private_postgres() as pg:
        settings = isolated_settings(tmp_path, pg.url, reconcile_interval_s=1)
        (team_dir(settings, "t") / "in.jsonl").write_text("{}\n")
        (team_dir(settings, "t") / "tok").mkdir()  # admission wants a tokenizer directory
        headers = auth(make_token(settings, "t"))
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            before = client.post("/v1/jobs", json=BODY, headers=headers)
            assert before.status_code == 201
            pg.stop()
            for path in (f"/v1/jobs/{before.json()['id']}", "/v1/jobs"):
                away = client.get(path, headers=headers)
                assert away.status_code == 503, away.text
                assert away.json()["code"] == "database_unavailable" and set(away.json()) >= {
                    "code",
                    "message",
                    "field",
                }
                assert away.headers["retry-after"]
            assert client.post("/v1/jobs", json=BODY, headers=headers).status_code == 503
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
            assert client.get("/healthz").status_code == 200  # the process itself is fine
            back = threading.Timer(1.0, pg.start)  # the database returns while the SDK is retrying
            back.start()
            client.headers.update(headers)
            assert Client(http=client).get_job(before.json()["id"])["id"] == before.json()["id"]  # rode it out
            back.join()
            deadline = time.monotonic() + 20
            while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            again = client.get(f"/v1/jobs/{before.json()['id']}", headers=headers)
            assert again.status_code == 200 and again.json()["id"] == before.json()["id"]
            assert client.post("/v1/jobs", json=BODY, headers=headers).status_code == 201
            listed = client.get("/v1/jobs", headers=headers).json()["data"]
            assert len(listed) == 2  # the job from before the outage and the one after


class _Engine:
    """Stands in for the engine process under watch_node: writes a metric point and a log line every 20 ms until
    told to exit (then exits 0)."""

    def __init__(self, run: RunDir):
        self.run, self.step, self.terminated = run, 0, False
        self.exit = threading.Event()

    def poll(self) -> int | None:
        self.run.metric(self.step, {"lm_loss": 1.0 / (self.step + 1)})
        with open(self.run.path / "logs" / "rank0.log", "a") as f:
            f.write(f"step {self.step}\n")
        self.step += 1
        return 0 if self.exit.is_set() else None

    def terminate(self, grace_s: float) -> int:
        self.terminated = True
        return -15


def _stored(settings: Any, job_id: str) -> tuple[list[int], list[int]]:
    with session_scope(settings.database_url) as session:
        steps = list(
            session.scalars(select(MetricPoint.step).where(MetricPoint.job_id == job_id).order_by(MetricPoint.step))
        )
        seqs = list(session.scalars(select(LogLine.seq).where(LogLine.job_id == job_id).order_by(LogLine.seq)))
    return steps, seqs


@pytest.mark.postgres
def test_a_running_job_survives_the_outage_and_its_ingest_catches_up(tmp_path: Path) -> None:
    with private_postgres() as pg:
        settings = isolated_settings(tmp_path, pg.url, ingest_interval_s=0.05, heartbeat_interval_s=0.5)
        job_id = make_job(settings)
        with session_scope(settings.database_url) as session:
            assert transition(session, job_id, JobState.starting, attempt_count=1)
            assert transition(session, job_id, JobState.running)
        run = RunDir(tmp_path / "run")
        work = NodeWork(0, job_id, 1, 0, 1, {}, run.path, [], "127.0.0.1", 0)
        ingestor, engine = RunIngestor(settings.database_url, job_id, run.path, 1), _Engine(run)
        outcome: list[tuple[int, str | None]] = []
        watch = threading.Thread(target=lambda: outcome.append(watch_node(settings, work, engine, ingestor)))  # type: ignore[arg-type]
        watch.start()
        deadline = time.monotonic() + 20
        while len(_stored(settings, job_id)[0]) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        pg.stop()
        time.sleep(1.5)  # the engine writes on; nothing can be stored
        assert ingestor.away_since is not None and watch.is_alive()
        pg.start()
        deadline = time.monotonic() + 20
        while ingestor.away_since is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.exit.set()
        watch.join(20)
        assert outcome == [(0, None)] and not engine.terminated  # the job kept running through the outage
        until_stored("final ingest", lambda: ingestor.poll(final=True), time.monotonic() + 60)
        steps, seqs = _stored(settings, job_id)
        assert steps == list(range(engine.step)) and seqs == list(range(engine.step))  # each once, none lost


def _declare(broker_url: str, var: str, barrier: Any, names: list[str]) -> None:
    from core.messaging import declare_queues
    from core.settings import Settings

    settings = Settings(
        var_dir=Path(var), broker_url=broker_url, database_url="", redis_url=None, data_roots=[], runs_dir=None
    )
    barrier.wait()
    declare_queues(settings, names)


def test_processes_declaring_the_same_queues_at_once_all_succeed(tmp_path: Path) -> None:
    broker = f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    procs = [
        context.Process(target=_declare, args=(broker, str(tmp_path), barrier, ["llmjobs.cpu", f"host.h{i}"]))
        for i in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    engine = sa.create_engine(broker.removeprefix("sqla+"))
    with engine.connect() as connection:
        names = sorted(connection.execute(sa.text("SELECT name FROM kombu_queue")).scalars())
    engine.dispose()
    assert names == ["host.h0", "host.h1", "host.h2", "host.h3", "llmjobs.cpu"]


def test_two_workers_starting_together_on_the_embedded_broker_both_come_up(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1)
    workers = [start_worker(settings, f"w{i}", 1, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert all(w.poll() is None for w in workers), [
                (tmp_path / f"w{i}.log").read_text()[-2000:] for i in range(2)
            ]
            if all("ready" in (tmp_path / f"w{i}.log").read_text() for i in range(2)):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("workers not ready: " + (tmp_path / "w0.log").read_text()[-2000:])
        with session_scope(settings.database_url) as session:
            assert sorted(h.name for h in session.scalars(select(Host))) == ["w0", "w1"]
    finally:
        for worker in workers:
            stop_worker(worker)
