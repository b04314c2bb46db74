"""Helpers of the scheduler's worker tests (not a test module): tiny train data and specs, real `llmjobs worker`
processes acting as hosts, a reconciler thread standing in for the API's, waits on job state."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import func, select

import train_support
from core.db import session_scope
from core.jobs import create_job
from core.models import Event, Job, LogLine
from core.paths import team_areas
from core.reconciler import reconcile_once
from core.settings import Settings
from core.states import JobState
from core_support import team_dir
from engine.contract.spec import parse_spec

TINY_SHAPE: dict[str, Any] = {
    **train_support.TINY_SHAPE,
    # Qwen3's values, set explicitly as a MindSpeed user would (Megatron's defaults are LayerNorm / learned positions).
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
}
write_tiny_data = train_support.write_instruction_data


def tiny_data(settings: Settings) -> str:
    """The tiny train data, written into the data area of team ``t`` (the team ``submit`` submits as)."""
    return write_tiny_data(team_dir(settings, "t") / "tiny")


def resumable_spec(data: str, save: Path, iters: int, max_restarts: int, save_interval: int = 10) -> dict[str, Any]:
    """The job the fault tests kill: two ranks over ``data`` for ``iters`` iterations, a checkpoint into ``save`` every
    ``save_interval``, at most ``max_restarts`` restarts."""
    return train_spec(
        data,
        train_iters=iters,
        save_interval=save_interval,
        save=str(save),
        max_restarts=max_restarts,
        resources={"nproc_per_node": 2},
    )


def train_spec(data: str, **overrides: Any) -> dict[str, Any]:
    return {
        "kind": "train",
        "data_path": [data],
        "split": "100,0,0",
        "train_iters": 4,
        "lr": 3e-3,
        "lr_warmup_iters": 1,
        "seq_length": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "log_interval": 1,
        "seed": 7,
        **TINY_SHAPE,
        **overrides,
    }


def submit(settings: Settings, raw: dict[str, Any], team: str = "t") -> str:
    with session_scope(settings.database_url) as session:
        job, _ = create_job(
            session, settings=settings, team=team, spec=parse_spec(raw, **team_areas(settings, team).context()), raw=raw
        )
        return job.id


def worker_env(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "LLMJOBS_VAR_DIR": str(settings.var_dir),
        "LLMJOBS_DATABASE_URL": settings.database_url,
        "LLMJOBS_BROKER_URL": settings.broker_url,
        "LLMJOBS_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_interval_s),
        "LLMJOBS_HOST_STALE_AFTER_S": str(settings.host_stale_after_s),
        "LLMJOBS_RETRY_BACKOFF_S": str(settings.retry_backoff_s),  # a worker ends a failed attempt: its own backoff
        "LLMJOBS_WORKER_ADDRESS": "127.0.0.1",
        "LLMJOBS_INGEST_INTERVAL_S": str(settings.ingest_interval_s),
        "OMP_NUM_THREADS": "1",
        "LLMJOBS_DATA_ROOTS": ",".join(str(r) for r in settings.data_roots),
    }


def start_worker(settings: Settings, host: str, devices: int, log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "worker", "--host", host, "--devices", str(devices)],
        env=worker_env(settings),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_worker(settings: Settings, host: str, devices: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``start_worker`` for the block, ``stop_worker`` when it ends (however it ends)."""
    proc = start_worker(settings, host, devices, log)
    try:
        yield proc
    finally:
        stop_worker(proc)


@contextmanager
def reconciler(settings: Settings, interval: float = 0.5) -> Iterator[None]:
    """What the API's lifespan loop does, in a thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):  # a busy database: next round
                reconcile_once(settings)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def job_row(settings: Settings, job_id: str) -> Job:
    with session_scope(settings.database_url) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def checkpoints(settings: Settings, job_id: str) -> int:
    """How many checkpoint events the job has recorded."""
    with session_scope(settings.database_url) as session:
        return int(
            session.scalar(
                select(func.count()).select_from(Event).where(Event.job_id == job_id, Event.type == "checkpoint")
            )
            or 0
        )


def wait_for(settings: Settings, job_id: str, pred: Any, timeout: float, what: str) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = job_row(settings, job_id)
        if pred(row):
            return row
        time.sleep(0.3)
    raise AssertionError(
        f"job {job_id}: not {what} after {timeout}s (state {row.state}, {row.pending_reason})\n"
        + log_text(settings, job_id)
    )


def wait_checkpointed(settings: Settings, job_id: str, timeout: float) -> Job:
    return wait_for(settings, job_id, lambda _: checkpoints(settings, job_id) >= 1, timeout, "checkpointed")


def wait_terminal(settings: Settings, job_id: str, timeout: float) -> Job:
    return wait_for(settings, job_id, lambda r: JobState(r.state).is_terminal(), timeout, "finished")


def log_text(settings: Settings, job_id: str, last: int = 30) -> str:
    with session_scope(settings.database_url) as session:
        lines = session.scalars(select(LogLine.text).where(LogLine.job_id == job_id).order_by(LogLine.id)).all()
    return "\n".join(lines[-last:])


def job_processes(job_id: str) -> list[int]:
    """Live processes (any parent) whose environment names this job: the engine, torchrun and its ranks."""
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("LLMJOBS_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


def describe_processes(pids: list[int]) -> str:
    """pid, parent and command line of each, for an assertion message."""
    lines = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            lines.append(f"{pid} (parent {proc.ppid()}, {proc.status()}): {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"{pid}: gone")
    return "\n".join(lines)
