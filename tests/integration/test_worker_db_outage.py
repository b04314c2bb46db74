"""A database outage around a job's launch and its end, on a private PostgreSQL with two real preprocess engines.

Launch: one node's claim, the other's running record, fall in an outage; both wait and the jobs run, each once.
End: the database stays away past ``database_away_deadline_s`` while both engines finish; each task parks its node's
exit in the run directory and returns. Once the database is back the lease sweep leaves the parked nodes alone and
the heartbeat's ``finish_parked`` stores them: both jobs succeed on their first attempt, with every run-file line
stored once.

The engines are held (SIGSTOP) from their start until the second outage: a preprocess of 50 lines may end before
the database is back (a CI run saw job 0 finish unseen), and the test must know both still run when it stops the
database again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import func, select

from core.db import get_engine, session_scope
from core.models import Attempt, Event, Host, Job, JobNode, Lease, LogLine
from core.scheduler import schedule
from core.settings import Settings
from core_support import isolated_settings, team_dir
from outage_support import private_postgres
from sched_support import submit
from worker.leases import sweep_host
from worker.node import claim_node, finish_parked, run_claimed, run_node
from worker.parked import parked_path

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
DEADLINE_S = 6.0


def _spec(n: int) -> dict[str, Any]:
    return {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": f"out/{n}/d"}


def _states(settings: Settings, ids: list[str]) -> list[str]:
    with session_scope(settings.database_url) as session:
        return [session.get(Job, job_id).state for job_id in ids]  # type: ignore[union-attr]


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.2)


class EngineHold:
    """Stops each engine this test process launches (its own session: pgid = pid) as soon as it appears."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        me = psutil.Process()
        while not self._done.is_set():
            for child in me.children():
                if child.pid not in self.held and _is_engine(child):
                    with contextlib.suppress(ProcessLookupError):  # gone already: never held, the wait says so
                        os.killpg(child.pid, signal.SIGSTOP)
                        self.held.add(child.pid)
            time.sleep(0.02)

    def release(self) -> None:
        self._done.set()
        self._thread.join()
        for pid in self.held:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)


def _is_engine(proc: psutil.Process) -> bool:
    try:
        return "engine" in proc.cmdline()
    except psutil.Error:
        return False


def _file_lines(run_dir: Path) -> tuple[int, int]:
    events = len((run_dir / "events.jsonl").read_text().splitlines())
    logs = sum(len(p.read_text().splitlines()) for p in (run_dir / "logs").glob("*.log"))
    return events, logs


def test_a_launch_waits_out_an_outage_and_an_exit_past_the_deadline_is_parked(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    with private_postgres() as pg:
        settings = isolated_settings(
            tmp_path, pg.url, database_away_deadline_s=DEADLINE_S, ingest_interval_s=0.2, heartbeat_interval_s=0.5
        )
        data = team_dir(settings, "t")
        shutil.copytree(qwen_tokenizer_dir, data / "tok")
        (data / "in.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
        with session_scope(settings.database_url) as session:
            session.add(Host(name="h1", device_type="cpu", devices=2, queue="host.h1", address="127.0.0.1", info={}))
        ids = [submit(settings, _spec(n)) for n in range(2)]
        assert len(schedule(settings)) == 2  # both nodes assigned to h1
        claimed = claim_node(settings, ids[0], 1, 0, "h1")
        assert claimed is not None
        outcomes: dict[str, str] = {}
        tasks = [
            threading.Thread(target=lambda: outcomes.update({ids[0]: run_claimed(settings, claimed, "h1")})),
            threading.Thread(target=lambda: outcomes.update({ids[1]: run_node(settings, ids[1], 1, 0, "h1")})),
        ]
        hold = EngineHold()
        try:
            pg.stop()  # job 0's running record and job 1's claim fall in the outage
            for task in tasks:
                task.start()
            time.sleep(2)
            pg.start()
            _wait(lambda: _states(settings, ids) == ["running", "running"] and len(hold.held) == 2, 60, "running")
            pg.stop()  # both engines finish while the database is away, past the deadline
        finally:
            hold.release()
        for task in tasks:
            task.join(120)
        assert outcomes == {ids[0]: "parked", ids[1]: "parked"}
        pg.start()
        get_engine(settings.database_url).dispose()  # connections of the stopped server: not needed, but quicker
        assert sweep_host(settings, "h1") == 0  # parked nodes are not lost
        assert _states(settings, ids) == ["running", "running"]
        assert finish_parked(settings, "h1") == 2
        assert finish_parked(settings, "h1") == 0  # stored once
        with session_scope(settings.database_url) as session:
            jobs = [session.get(Job, job_id) for job_id in ids]
            assert [(j.state, j.attempt_count) for j in jobs] == [("succeeded", 1)] * 2  # type: ignore[union-attr]
            assert session.scalar(select(func.count()).select_from(Attempt)) == 2
            nodes = list(session.scalars(select(JobNode)))
            assert [(n.state, n.exit_code, n.released_at is not None) for n in nodes] == [("exited", 0, True)] * 2
            assert session.scalars(select(Lease)).all() == []
            for job in jobs:
                assert job is not None
                run_dir = Path(job.run_dir)
                assert not parked_path(run_dir, 1, 0).exists()
                stored = (
                    session.scalar(select(func.count()).select_from(Event).where(Event.job_id == job.id)),
                    session.scalar(select(func.count()).select_from(LogLine).where(LogLine.job_id == job.id)),
                )
                # every engine line once (the state events are the service's own, not in the files)
                states = session.scalar(
                    select(func.count()).select_from(Event).where(Event.job_id == job.id, Event.type == "state")
                )
                assert (stored[0] - states, stored[1]) == _file_lines(run_dir)  # type: ignore[operator]
