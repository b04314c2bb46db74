"""Run one job attempt: claim the row, launch the engine, ingest its files, watch for cancel, record the outcome.

Celery-free, so it is tested directly. The job row decides: a claim is a compare-and-set from queued/retrying to
starting, so a redelivered or duplicate message never runs a job twice.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select, update

from app.db import session_scope
from app.dispatch import dispatch
from app.models import Artifact, Attempt, Job, utcnow
from app.pubsub import notify
from app.services.jobs import transition
from app.settings import Settings
from app.states import WAITING, JobState
from engine.runfiles import EXIT_BAD_INPUT, EXIT_OK, EXIT_RETRYABLE, read_result
from engine.spec import parse_spec
from worker.ingest import RunIngestor
from worker.launcher import build_launch
from worker.supervisor import Supervised

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 40


@dataclass
class Claim:
    job_id: str
    attempt: int
    spec: dict[str, Any]
    run_dir: Path
    queue: str
    max_restarts: int


def claim(settings: Settings, job_id: str, host: str) -> Claim | None:
    """queued/retrying -> starting, or None when another worker (or a cancel) got there first."""
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        if job is None or JobState(job.state) not in WAITING:
            return None
        number = job.attempt_count + 1
        if not transition(session, job_id, JobState.starting, only_from=WAITING, host=host, attempt_count=number,
                          heartbeat_at=utcnow(), message=f"starting attempt {number} on {host}"):
            return None
        return Claim(job_id, number, job.spec, Path(job.run_dir), job.queue, job.max_restarts)


def write_spec(run_dir: Path, spec: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    tmp = run_dir / ".spec.json.tmp"
    tmp.write_text(json.dumps(spec, indent=2))
    tmp.replace(run_dir / "spec.json")


def log_tail(run_dir: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of the launcher log (all ranks' stderr), else of rank 0's log."""
    for name in ("launcher.log", "rank0.log"):
        path = run_dir / "logs" / name
        if path.exists() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 64_000))
                return "\n".join(f.read().decode("utf-8", errors="replace").splitlines()[-lines:])
    return ""


def execute_job(settings: Settings, job_id: str, host: str) -> str:
    """Run the job if it is still waiting; returns a short word for the task log."""
    work = claim(settings, job_id, host)
    if work is None:
        return "skipped"
    notify(settings.redis_url, job_id, state=1)
    write_spec(work.run_dir, work.spec)
    ingestor = RunIngestor(settings.database_url, job_id, work.run_dir, work.attempt, settings.redis_url)
    plan = build_launch(parse_spec(work.spec), work.run_dir, job_id=job_id)
    proc = Supervised(plan, work.run_dir / "logs" / "launcher.log")
    try:
        with session_scope(settings.database_url) as session:
            session.add(Attempt(job_id=job_id, number=work.attempt, host=host, pid=proc.pid, argv=plan.argv))
            session.commit()
            transition(session, job_id, JobState.running, only_from=[JobState.starting], message=f"running (pid {proc.pid})")
        notify(settings.redis_url, job_id, state=1)
        code, stop_reason = watch(settings, work, proc, ingestor)
    finally:
        if proc.poll() is None:  # an exception above: never leave the engine running unsupervised
            proc.terminate(settings.cancel_grace_s)
    ingestor.poll(final=True)
    return finish(settings, work, code, stop_reason, ingestor, survivors=proc.survivors())


def watch(settings: Settings, work: Claim, proc: Supervised, ingestor: RunIngestor) -> tuple[int, str | None]:
    """Ingest while the engine runs; stop it on cancel or run deadline. Returns (exit code, stop reason)."""
    deadline = work.spec.get("run_deadline_s")
    started = last_beat = time.monotonic()
    while (code := proc.poll()) is None:
        try:
            ingestor.poll()
        except Exception as err:  # noqa: BLE001 - the offsets did not move; the next poll retries
            log.warning("ingest of %s failed, will retry: %s", work.job_id, err)
        now = time.monotonic()
        beat = now - last_beat >= settings.heartbeat_interval_s
        state = _check_state(settings, work.job_id, heartbeat=beat)
        last_beat = now if beat else last_beat
        if state is JobState.cancelling:
            return proc.terminate(settings.cancel_grace_s), "cancelled"
        if deadline and now - started > deadline:
            return proc.terminate(settings.cancel_grace_s), "run_deadline"
        time.sleep(settings.ingest_interval_s)
    return code, None


def _check_state(settings: Settings, job_id: str, heartbeat: bool) -> JobState:
    with session_scope(settings.database_url) as session:
        if heartbeat:
            session.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=utcnow()))
        return JobState(session.scalar(select(Job.state).where(Job.id == job_id)))


def record_artifacts(settings: Settings, job_id: str, outputs: dict[str, str]) -> None:
    with session_scope(settings.database_url) as session:
        session.execute(delete(Artifact).where(Artifact.job_id == job_id))
        for name, value in outputs.items():
            files = _artifact_files(Path(value))
            session.add(Artifact(job_id=job_id, name=name, path=value, files=[str(f) for f in files[:1000]],
                                 size_bytes=sum(f.stat().st_size for f in files) if files else None))


def _artifact_files(path: Path) -> list[Path]:
    """A directory's files, a file, or the files sharing a prefix (Megatron's ``<prefix>_*.bin/.idx``)."""
    if not path.is_absolute():  # an output that is not a path (e.g. a list of names)
        return []
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_file():
        return [path]
    return sorted(p for p in path.parent.glob(path.name + "*") if p.is_file()) if path.parent.is_dir() else []


def finish(settings: Settings, work: Claim, code: int, stop_reason: str | None, ingestor: RunIngestor,
           survivors: list[int]) -> str:
    """Record the attempt and move the job to its outcome state."""
    error = ingestor.last_error or {}
    message = str(error.get("message") or f"the engine exited with code {code}")
    with session_scope(settings.database_url) as session:
        session.execute(update(Attempt).where(Attempt.job_id == work.job_id, Attempt.number == work.attempt)
                        .values(exit_code=code, finished_at=utcnow(), outcome=stop_reason or ("ok" if code == 0 else "error")))
        session.commit()
        failed = {"error_message": message, "error_log_tail": log_tail(work.run_dir)}
        if survivors:
            failed["error_message"] = f"{message}; processes still alive after SIGKILL: {survivors}"
        if stop_reason == "cancelled":
            outcome, ok = "cancelled", transition(session, work.job_id, JobState.cancelled,
                                                  message=f"cancelled; engine exit code {code}")
        elif stop_reason == "run_deadline":
            outcome, ok = "failed", transition(session, work.job_id, JobState.failed, error_code="run_deadline_exceeded",
                                               message="run deadline exceeded", **failed)
        elif code == EXIT_OK:
            outcome, ok = _succeed(settings, session, work)
        elif code == EXIT_RETRYABLE and work.attempt <= work.max_restarts:
            outcome, ok = "retrying", transition(session, work.job_id, JobState.retrying,
                                                 message=f"retrying after exit code {code} ({work.attempt} of "
                                                         f"{work.max_restarts + 1} attempts used): {message}")
        else:
            code_name = {EXIT_BAD_INPUT: "bad_input", EXIT_RETRYABLE: "retries_exhausted"}.get(
                code, "killed" if code < 0 else "engine_error")
            outcome, ok = "failed", transition(session, work.job_id, JobState.failed, error_code=code_name,
                                               message=message, **failed)
    if not ok:
        log.warning("job %s: could not record outcome %s (state changed meanwhile)", work.job_id, outcome)
    notify(settings.redis_url, work.job_id, state=1)
    if outcome == "retrying" and ok:
        dispatch(settings, work.job_id, work.queue)
    return outcome


def _succeed(settings: Settings, session: Any, work: Claim) -> tuple[str, bool]:
    result = read_result(work.run_dir)
    if result is None:
        return "failed", transition(session, work.job_id, JobState.failed, error_code="no_result",
                                    error_message="the engine exited 0 without writing result.json",
                                    error_log_tail=log_tail(work.run_dir))
    record_artifacts(settings, work.job_id, result.get("outputs") or {})
    return "succeeded", transition(session, work.job_id, JobState.succeeded, result=result,
                                   message=f"{result.get('kind', 'job')} succeeded")
