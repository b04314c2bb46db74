"""The Slurm agent (``llmjobs slurm-agent``): submits Slurm pools' jobs (``resources.pool``) with sbatch, follows
them with one batched sacct/squeue per interval, moves the jobs' states, and ingests their run directories.

Why a process of its own on the worker side: a Slurm job has no pinned worker to launch and watch it, and what the
agent needs is the worker's (the engine's command line, ``worker.launcher``; the run-directory reader,
``worker.ingest``), which the API process may not import. It must run where ``sbatch`` works and the run directories
(the service's runs_dir, on the pool's shared filesystem) are readable: a login node. Several agents may run; one
leads (a PostgreSQL advisory lock of its own), the others wait. Everything it knows is in the database and Slurm, so a
restarted agent re-reads both and goes on; a job whose sbatch answered but whose id was never stored is found again
by its name (``llmjobs-<job id>``) instead of being submitted twice.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from core.leadership import Leadership
from core.paths import team_areas
from core.pipelines import advance_parent
from core.pubsub import notify
from core.settings import Settings
from core.slurm import tracker
from core.slurm.queue import Queue, SlurmJob, SlurmUnavailable, SubmitRefused, cancel, submit
from core.slurm.script import HEAD, NODE_RANK, SLURM_JOB, job_name, render
from core.slurm.states import Outcome, is_final, outcome
from core.slurm.tracker import CANCEL_STATES, SlurmRow
from core.states import WAITING, JobState
from engine.contract.runfiles import EXIT_BAD_INPUT, read_result
from engine.contract.spec import parse_spec
from worker.execute import log_tail, record_artifacts, write_spec
from worker.ingest import RunIngestor
from worker.launcher import Rendezvous, build_launch
from worker.node import spec_with_deployment

log = logging.getLogger(__name__)
OFFSETS_FILE = "slurm-ingest.json"  # how far the run files were stored, so a restarted agent neither skips nor repeats
MISSING_POLLS = 3  # polls a job may be absent from Slurm's answer before the run directory decides it
MAX_BACKOFF = 16  # the interval grows to this many times slurm_poll_interval_s while Slurm does not answer
WAITING_VALUES = {s.value for s in WAITING}


def engine_command(settings: Settings, row: SlurmRow) -> tuple[list[str], dict[str, str]]:
    """The engine's command line and environment, as a pinned host's node runs it (``worker.launcher``), with the
    rendezvous, node rank and rendezvous id left to Slurm (``core.slurm.script`` placeholders)."""
    spec = parse_spec(row.spec)
    pool = settings.slurm_pools[spec.resources.pool or ""]
    run_dir = Path(row.run_dir)
    plan = build_launch(
        spec,
        run_dir,
        job_id=row.job_id,
        python=pool.python or sys.executable,
        base_env={},
        rendezvous=Rendezvous(HEAD, pool.rdzv_port, 0),
    )
    argv = list(plan.argv)
    for flag, value in (("--node-rank", NODE_RANK), ("--rdzv-id", SLURM_JOB)):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    env = {**plan.env, **team_areas(settings, row.team).env(), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return argv, env


def find_by_name(job_id: str) -> str | None:
    """The Slurm job already submitted for this job (an agent that died between sbatch and recording its id)."""
    try:
        done = subprocess.run(
            ["squeue", "-h", "--states=all", "-n", job_name(job_id), "-o", "%i"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmUnavailable(f"squeue: {err}") from err
    ids = done.stdout.split()
    return ids[-1] if done.returncode == 0 and ids else None


@dataclass
class SlurmAgent:
    settings: Settings
    queue: Queue = field(default_factory=Queue)
    ingestors: dict[str, RunIngestor] = field(default_factory=dict)
    missing: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ submission

    def submit_waiting(self) -> int:
        submitted = 0
        for row in tracker.to_submit(self.settings):
            submitted += self.submit(row)
        return submitted

    def submit(self, row: SlurmRow) -> bool:
        spec = parse_spec(row.spec)
        pool = self.settings.slurm_pools.get(spec.resources.pool or "")
        if pool is None:  # the setting changed since admission
            return tracker.fail(
                self.settings,
                row,
                error_code="slurm_pool_missing",
                message=f"resources.pool: the service has no Slurm pool {spec.resources.pool!r} any more",
            )
        run_dir = Path(row.run_dir)
        write_spec(run_dir, spec_with_deployment(self.settings, row.team, row.spec))
        argv, env = engine_command(self.settings, row)
        script = render(pool, job_id=row.job_id, nnodes=spec.resources.nnodes, run_dir=run_dir, argv=argv, env=env)
        (run_dir / "slurm.sbatch").write_text(script)
        try:
            slurm_id = find_by_name(row.job_id) or submit(script, cwd=str(run_dir))
        except SubmitRefused as err:
            return tracker.fail(
                self.settings, row, error_code="slurm_submit_refused", message=f"sbatch refused the job: {err}"
            )
        if not tracker.record_submitted(self.settings, row.job_id, slurm_id):
            cancel([slurm_id])  # the job was cancelled while sbatch ran
            return False
        log.info("job %s submitted to Slurm as %s", row.job_id, slurm_id)
        notify(self.settings.redis_url, row.job_id, state=1)
        return True

    # ------------------------------------------------------------------ tracking

    def track(self) -> int:
        """One batched read of Slurm for every live job, and each job's move. Raises SlurmUnavailable."""
        rows = tracker.live(self.settings)
        if not rows:
            return 0
        slurm = self.queue.read(sorted({r.slurm_job_id for r in rows if r.slurm_job_id}))
        for row in rows:
            try:
                self.apply(row, slurm.get(row.slurm_job_id or ""))
            except Exception:  # noqa: BLE001 - one job's trouble must not stop the others; next poll retries
                log.exception("job %s: applying Slurm's state failed", row.job_id)
        return len(rows)

    def apply(self, row: SlurmRow, job: SlurmJob | None) -> None:
        settings = self.settings
        if row.state in CANCEL_STATES and (job is None or not is_final(job.state)):
            cancel([row.slurm_job_id or ""])  # asked through the API; scancel again each poll until Slurm ends it
        if job is None:
            self.missing[row.job_id] = self.missing.get(row.job_id, 0) + 1
            if self.missing[row.job_id] >= MISSING_POLLS:
                self.decide_from_run_dir(row)
            return
        self.missing.pop(row.job_id, None)
        if job.state != row.slurm_state:
            tracker.set_slurm_state(settings, row.job_id, job.state)
        step = outcome(job.state)
        if step in (Outcome.waiting, Outcome.retrying):  # pending, or requeued: a running attempt ends retrying
            self.finish_ingest(row)
            tracker.wait(settings, row, job.reason)
        elif step in (Outcome.starting, Outcome.running):
            row = self.started(row, job)
            if step is Outcome.running and row.state == JobState.starting.value and tracker.run(settings, row):
                row = replace(row, state=JobState.running.value)
            self.ingest(row)
        else:
            row = self.started(row, job)  # it ran between two polls
            self.finish_ingest(row)
            self.end(row, job, step)
            advance_parent(settings, row.job_id)  # the next step of its pipeline, if it is one
        notify(settings.redis_url, row.job_id, state=1)

    def started(self, row: SlurmRow, job: SlurmJob) -> SlurmRow:
        if row.state not in WAITING_VALUES:
            return row
        attempt = tracker.start(self.settings, row, job.nodes)
        if attempt is None:
            return row
        advance_parent(self.settings, row.job_id)  # a pipeline runs once its step does
        return replace(row, state=JobState.starting.value, attempt=attempt)

    def end(self, row: SlurmRow, job: SlurmJob, step: Outcome) -> None:
        settings, run_dir = self.settings, Path(row.run_dir)
        if step is Outcome.cancelled:
            tracker.cancelled(settings, row)
            return
        if step is Outcome.succeeded:
            result = read_result(run_dir)
            if result is not None:
                record_artifacts(settings, row.job_id, result.get("outputs") or {})
                tracker.succeed(settings, row, result)
                return
            tracker.fail(
                settings,
                row,
                error_code="no_result",
                message=f"Slurm job {row.slurm_job_id} completed without the engine's result.json",
                exit_code=job.exit_code,
                log_tail=log_tail(run_dir),
            )
            return
        code = job.exit_code
        name = "bad_input" if code == EXIT_BAD_INPUT else f"slurm_{job.state.split(' ')[0].lower()}"
        signal = f", signal {job.signal}" if job.signal else ""
        reason = f" ({job.reason})" if job.reason and job.reason != "None" else ""
        tracker.fail(
            settings,
            row,
            error_code=name[:64],
            message=f"Slurm job {row.slurm_job_id} {job.state}: exit code {code}{signal}{reason}",
            exit_code=code,
            log_tail=log_tail(run_dir),
        )

    def decide_from_run_dir(self, row: SlurmRow) -> None:
        """Slurm no longer lists the job (squeue past MinJobAge, no accounting): the engine's result decides."""
        self.missing.pop(row.job_id, None)
        self.finish_ingest(row)
        if row.state in CANCEL_STATES:
            tracker.set_slurm_state(self.settings, row.job_id, "CANCELLED")
            tracker.cancelled(self.settings, row)
            return
        result = read_result(Path(row.run_dir))
        gone = SlurmJob(row.slurm_job_id or "", "COMPLETED" if result else "FAILED", None, None, "", "gone")
        tracker.set_slurm_state(self.settings, row.job_id, gone.state)
        row = self.started(row, gone)
        if result is not None:
            self.end(row, gone, Outcome.succeeded)
        else:
            tracker.fail(
                self.settings,
                row,
                error_code="slurm_job_lost",
                message=f"Slurm job {row.slurm_job_id} is no longer known to Slurm and left no result",
                log_tail=log_tail(Path(row.run_dir)),
            )
        advance_parent(self.settings, row.job_id)

    # ------------------------------------------------------------------ run files

    def _ingestor(self, row: SlurmRow) -> RunIngestor:
        current = self.ingestors.get(row.job_id)
        if current is not None and current.attempt == row.attempt:
            return current
        run_dir = Path(row.run_dir)
        offsets = current.offsets() if current is not None else _stored_offsets(run_dir)
        ingestor = RunIngestor(
            self.settings.database_url,
            row.job_id,
            run_dir,
            max(row.attempt, 1),
            self.settings.redis_url,
            start_offsets=offsets,
        )
        self.ingestors[row.job_id] = ingestor
        return ingestor

    def ingest(self, row: SlurmRow, final: bool = False) -> None:
        ingestor = self._ingestor(row)
        ingestor.poll(final=final)
        _store_offsets(Path(row.run_dir), ingestor.offsets())

    def finish_ingest(self, row: SlurmRow) -> None:
        if row.attempt or row.job_id in self.ingestors:
            self.ingest(row, final=True)
        self.ingestors.pop(row.job_id, None)

    # ------------------------------------------------------------------ loop

    def tick(self) -> None:
        self.submit_waiting()
        self.track()


def _stored_offsets(run_dir: Path) -> dict[str, int]:
    try:
        stored = json.loads((run_dir / OFFSETS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        stored = {}
    return {"events.jsonl": 0, "metrics.jsonl": 0, **{k: int(v) for k, v in stored.items()}}


def _store_offsets(run_dir: Path, offsets: dict[str, int]) -> None:
    tmp = run_dir / f".{OFFSETS_FILE}.tmp"
    tmp.write_text(json.dumps(offsets))
    tmp.replace(run_dir / OFFSETS_FILE)


def run_forever(settings: Settings, stop: threading.Event | None = None) -> None:
    """Tick every ``slurm_poll_interval_s`` while leading; back off (doubling, up to ``MAX_BACKOFF`` times) while
    Slurm or the database does not answer."""
    stop = stop or threading.Event()
    leader = Leadership(settings.database_url, name="llmjobs-slurm-agent")
    agent = SlurmAgent(settings)
    factor = 1
    try:
        while not stop.is_set():
            try:
                if leader.is_leader():
                    agent.tick()
                factor = 1
            except Exception as err:  # noqa: BLE001 - Slurm or the database is away: wait longer, then again
                factor = min(factor * 2, MAX_BACKOFF)
                log.warning("slurm agent: %s; next try in %.0f s", err, settings.slurm_poll_interval_s * factor)
            stop.wait(settings.slurm_poll_interval_s * factor)
    finally:
        leader.release()
