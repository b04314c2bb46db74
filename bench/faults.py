"""Fault figures: one kind of fault, injected ``--runs N`` times into a real deployment; one JSON line of counts.

- ``worker-kill``: a tiny two-rank CPU train job (``tests/integration/sched_support.py``'s spec) on a real
  `llmjobs worker`, checkpointing every ``--save-interval`` iterations; once it has checkpointed the worker is
  SIGKILLed, the reconciler re-queues the job, a new worker comes up on the same host and the job resumes. Counts:
  resumed (attempt 2, ``resumed_from`` set), succeeded, ``final_lm_loss`` equal to one uninterrupted run's.
- ``replica-kill``: two `llmjobs api` replicas on one PostgreSQL, two workers, ``--jobs`` preprocess jobs submitted
  to both replicas and a webhook; the leading replica is SIGKILLed once a quarter of the jobs finished. Counts: jobs
  lost (not succeeded) or dispatched twice (more than one node row), webhook message ids not received or received
  twice (at-least-once: the one message in flight when the leader died may come twice), the takeover time.
- ``db-restart``: a worker and the reconciler on a private PostgreSQL; ``--jobs`` tiny train jobs run and ingest
  while PostgreSQL is stopped for ``--outage-s`` and started again. Counts: jobs lost or retried, metric points and
  log lines missing from or stored twice in the database, against the engine's own run files.
- ``broker-restart``: a worker and the reconciler with a private Redis as broker (no persistence: a restart loses
  every message it held); a job runs when Redis stops, ``--jobs`` more are submitted while it is down, Redis starts
  after ``--outage-s``. Counts: jobs lost or run twice.

Each kind builds its deployment from ``tests/integration``'s support modules (``sched_support``, ``outage_support``,
``replica_support``), the same mechanics as the tests.

    python bench/faults.py --fault worker-kill --runs 3
    python bench/faults.py --fault db-restart --runs 5
    python bench/faults.py --smoke   # worker-kill once, 30 iterations (CI; a resumed run needs iterations left after its checkpoint)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

import httpx  # noqa: E402
from sqlalchemy import distinct, func, select, tuple_  # noqa: E402

import sched_support as sched  # noqa: E402
from cli.demo import tokenizer_source  # noqa: E402
from core.db import get_engine, session_scope  # noqa: E402
from core.models import Job, JobNode, LogLine, MetricPoint, WebhookDelivery, utcnow  # noqa: E402
from core.settings import Settings  # noqa: E402
from core.states import JobState  # noqa: E402
from core_support import auth, fresh_postgres_database, isolated_settings, make_token, team_dir  # noqa: E402
from outage_support import PrivatePostgres, PrivateRedis, private_postgres, private_redis  # noqa: E402
from replica_support import (  # noqa: E402
    delivered_count,
    leader_pid,
    start_api,
    stop_api,
    terminal,
    wait,
    webhook_receiver,
)
from worker.ingest import metric_rows  # noqa: E402

FAST = {"heartbeat_interval_s": 1, "host_stale_after_s": 15, "ingest_interval_s": 0.3, "redispatch_after_s": 3}


def settle(pred: Callable[[], Any], timeout: float) -> bool:
    """Whether ``pred`` became true within ``timeout`` (database errors while it is away count as not yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the database or an API replica may be away mid-fault
            if pred():
                return True
        time.sleep(0.3)
    return False


def job_counts(settings: Settings, ids: list[str]) -> dict[str, int]:
    """Of ``ids``: how many succeeded on their first attempt with one node, how many did not end succeeded (lost),
    how many ran more than one attempt or node (retried / dispatched twice)."""
    with session_scope(settings.database_url) as session:
        jobs = list(session.scalars(select(Job).where(Job.id.in_(ids))))
        nodes = dict(
            session.execute(
                select(JobNode.job_id, func.count()).where(JobNode.job_id.in_(ids)).group_by(JobNode.job_id)
            ).all()
        )
    return {
        "succeeded_once": sum(j.state == "succeeded" and j.attempt_count == 1 and nodes.get(j.id) == 1 for j in jobs),
        "lost": len(ids) - sum(j.state == "succeeded" for j in jobs),
        "run_twice": sum(j.attempt_count > 1 or nodes.get(j.id, 0) > 1 for j in jobs),
    }


def total(runs: list[dict[str, Any]], key: str) -> int:
    return sum(int(r[key]) for r in runs)


# worker-kill ----------------------------------------------------------------------------------------------------


def worker_kill_run(settings: Settings, spec: dict[str, Any], log: Path, kill: bool) -> dict[str, Any]:
    proc = sched.start_worker(settings, "h1", 2, log)
    try:
        job_id = sched.submit(settings, spec)
        if kill:
            sched.wait_checkpointed(settings, job_id, 600)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            sched.wait_for(settings, job_id, lambda r: r.state == "retrying", 120, "re-queued")
            proc = sched.start_worker(settings, "h1", 2, log)  # the host comes back
        row = sched.wait_terminal(settings, job_id, 1200)
    finally:
        sched.stop_worker(proc)
    summary = (row.result or {}).get("summary") or {}
    return {
        "state": row.state,
        "attempts": row.attempt_count,
        "resumed": bool(summary.get("resumed_from")),
        "final_lm_loss": summary.get("final_lm_loss"),
    }


def worker_kill(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    settings = isolated_settings(root / "var", heartbeat_interval_s=1, host_stale_after_s=6, ingest_interval_s=0.3)
    area = team_dir(settings, "t")  # the submitting team's data area (sched_support.submit submits as "t")
    data = sched.tiny_data(settings)

    def spec(name: str) -> dict[str, Any]:
        return sched.resumable_spec(
            data, area / name, iters=args.iters, max_restarts=2, save_interval=args.save_interval
        )

    with sched.reconciler(settings):
        baseline = worker_kill_run(settings, spec("baseline"), root / "worker.log", kill=False)
        runs = [worker_kill_run(settings, spec(f"run{i}"), root / "worker.log", kill=True) for i in range(args.runs)]
    base = baseline["final_lm_loss"]

    def close(loss: float | None) -> bool:
        return loss is not None and base is not None and abs(loss - base) <= args.tolerance * max(abs(base), 1e-12)

    return {
        "iters": args.iters,
        "save_interval": args.save_interval,
        "baseline_state": baseline["state"],
        "baseline_final_lm_loss": base,
        "resumed": sum(r["resumed"] and r["attempts"] == 2 for r in runs),
        "succeeded": sum(r["state"] == "succeeded" for r in runs),
        "final_loss_equal": sum(r["final_lm_loss"] == base for r in runs),
        "final_loss_within_tolerance": sum(close(r["final_lm_loss"]) for r in runs),
        "final_lm_losses": [r["final_lm_loss"] for r in runs],
    }


# replica-kill ---------------------------------------------------------------------------------------------------


def preprocess_spec(n: int) -> dict[str, Any]:
    return {
        "kind": "preprocess",
        "input": "in.jsonl",
        "tokenizer_name_or_path": "tok",
        "output_prefix": f"out/{n}/d",
        "name": f"job-{n}",
    }


def replica_kill_run(settings: Settings, jobs: int, logs: Path) -> dict[str, Any]:
    data = team_dir(settings, "t")
    shutil.copytree(tokenizer_source(), data / "tok")
    (data / "in.jsonl").write_text(
        "".join(json.dumps({"text": f"line {i} of a replica run"}) + "\n" for i in range(20))
    )
    headers = auth(make_token(settings, "t"))
    with ExitStack() as stack:
        hook_url, ids = stack.enter_context(webhook_receiver())
        replicas = [start_api(settings, logs / f"api{i}.log") for i in range(2)]
        for proc, _ in replicas:
            stack.callback(stop_api, proc)
        for i in range(2):
            stack.enter_context(sched.running_worker(settings, f"h{i}", 2, logs / f"h{i}.log"))
        hook = httpx.post(f"{replicas[0][1]}/v1/webhooks", json={"url": hook_url}, headers=headers, timeout=30)
        assert hook.status_code == 201, hook.text
        for n in range(jobs):  # alternate replicas: jobs committed by the one about to die must still run
            answer = httpx.post(f"{replicas[n % 2][1]}/v1/jobs", json=preprocess_spec(n), headers=headers, timeout=30)
            assert answer.status_code == 201, answer.text
        first = wait(lambda: leader_pid(settings), 60, "led by a replica")
        victim = next(proc for proc, _ in replicas if proc.pid == first)
        wait(lambda: len(terminal(settings)) >= max(1, jobs // 4), 600, "a quarter of the jobs done")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        killed_at = time.monotonic()
        took_over = settle(lambda: leader_pid(settings) not in (None, first), 60)
        takeover_s = time.monotonic() - killed_at
        settle(lambda: len(terminal(settings)) == jobs, 900)
        # a message the killed leader POSTed but had not recorded is sent again after webhook_timeout_s + 30 s
        settle(lambda: delivered_count(settings) == jobs, settings.webhook_timeout_s + 60)
        time.sleep(3)  # a further duplicate would arrive within a few sender ticks
        received = dict(ids)
    with session_scope(settings.database_url) as session:
        job_ids = list(session.scalars(select(Job.id)))
        messages = set(session.scalars(select(WebhookDelivery.id)))
    counts = job_counts(settings, job_ids)
    return {
        **counts,
        "takeover_s": round(takeover_s, 1) if took_over else None,
        "webhook_messages": len(messages),
        "webhooks_missing": len(messages - set(received)),
        "webhooks_received_twice": sum(n > 1 for n in received.values()),
    }


def replica_kill(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    runs = []
    with private_postgres() as pg:
        for i in range(args.runs):
            with fresh_postgres_database(pg.url) as url:
                settings = isolated_settings(root / f"run{i}", url, **FAST)
                runs.append(replica_kill_run(settings, args.jobs, root / f"run{i}"))
    return {
        "jobs_per_run": args.jobs,
        "jobs_lost": total(runs, "lost"),
        "jobs_run_twice": total(runs, "run_twice"),
        "jobs_succeeded_once": total(runs, "succeeded_once"),
        "webhooks_missing": total(runs, "webhooks_missing"),
        "webhooks_received_twice": total(runs, "webhooks_received_twice"),
        "takeover_s": [r["takeover_s"] for r in runs],
    }


# db-restart -----------------------------------------------------------------------------------------------------


def file_lines(job: Job) -> tuple[set[tuple[int, str, int | None]], int]:
    """The metric points (step, name, rank) and the number of log lines in the job's own run files."""
    run_dir = Path(job.run_dir)
    records = []
    for path in [run_dir / "metrics.jsonl", *run_dir.glob("telemetry-node*.jsonl")]:
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    points = {(r["step"], r["name"], r["rank"]) for r in metric_rows(job.id, records)}
    logs = sum(len(p.read_text().splitlines()) for p in (run_dir / "logs").glob("*.log"))
    return points, logs


def stored_lines(settings: Settings, job_id: str) -> tuple[int, int, int]:
    """Metric point rows, distinct metric points and log line rows of the job in the database."""
    with session_scope(settings.database_url) as session:
        rows = session.scalar(select(func.count()).select_from(MetricPoint).where(MetricPoint.job_id == job_id))
        keys = tuple_(MetricPoint.step, MetricPoint.name, func.coalesce(MetricPoint.rank, -1))
        distinct_rows = session.scalar(select(func.count(distinct(keys))).where(MetricPoint.job_id == job_id))
        logs = session.scalar(select(func.count()).select_from(LogLine).where(LogLine.job_id == job_id))
    return int(rows or 0), int(distinct_rows or 0), int(logs or 0)


def ingest_counts(settings: Settings, ids: list[str]) -> dict[str, int]:
    out = {"metric_points": 0, "metric_points_missing": 0, "metric_points_twice": 0, "log_lines": 0}
    out |= {"log_lines_missing": 0, "log_lines_extra": 0}
    with session_scope(settings.database_url) as session:
        jobs = list(session.scalars(select(Job).where(Job.id.in_(ids))))
    for job in jobs:
        points, logs = file_lines(job)
        rows, distinct_rows, stored_logs = stored_lines(settings, job.id)
        out["metric_points"] += len(points)
        out["metric_points_missing"] += len(points) - distinct_rows
        out["metric_points_twice"] += rows - distinct_rows
        out["log_lines"] += logs
        out["log_lines_missing"] += max(0, logs - stored_logs)
        out["log_lines_extra"] += max(0, stored_logs - logs)
    return out


def points_stored(settings: Settings, job_id: str) -> int:
    with session_scope(settings.database_url) as session:
        return int(session.scalar(select(func.count()).select_from(MetricPoint).where(MetricPoint.job_id == job_id)))


def running(settings: Settings, ids: list[str]) -> bool:
    with session_scope(settings.database_url) as session:
        states = list(session.scalars(select(Job.state).where(Job.id.in_(ids))))
    return states == [JobState.running.value] * len(ids) and all(points_stored(settings, j) >= 5 for j in ids)


def ended_after(settings: Settings, ids: list[str], when: datetime) -> bool:
    """Every job of ``ids`` ended after ``when`` (so it ran through what came before)."""
    with session_scope(settings.database_url) as session:
        ends = list(session.scalars(select(Job.finished_at).where(Job.id.in_(ids))))
    return all(end is not None and end.replace(tzinfo=timezone.utc) > when for end in ends)


def finished(settings: Settings, ids: list[str]) -> bool:
    with session_scope(settings.database_url) as session:
        states = list(session.scalars(select(Job.state).where(Job.id.in_(ids))))
    return all(JobState(s).is_terminal() for s in states)


def db_restart_run(settings: Settings, pg: PrivatePostgres, spec: dict[str, Any], args: argparse.Namespace) -> dict:
    ids = [sched.submit(settings, spec) for _ in range(args.jobs)]
    reached = settle(lambda: running(settings, ids), 600)
    pg.stop()  # mid-run: the engines train on, their workers buffer in the run files
    time.sleep(args.outage_s)
    pg.start()
    back = utcnow()
    get_engine(settings.database_url).dispose()  # this process's pool: no dead connections to try
    settle(lambda: finished(settings, ids), 900)
    return {"reached_mid_run": reached and ended_after(settings, ids, back), **job_counts(settings, ids)} | (
        ingest_counts(settings, ids)
    )


def db_restart(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    with private_postgres() as pg:
        settings = isolated_settings(root / "var", pg.url, **FAST)
        data = sched.tiny_data(settings)
        spec = sched.train_spec(data, train_iters=args.iters, resources={"nproc_per_node": 1})
        with sched.reconciler(settings), sched.running_worker(settings, "h1", args.jobs, root / "worker.log"):
            runs = [db_restart_run(settings, pg, spec, args) for _ in range(args.runs)]
    keys = ["lost", "run_twice", "succeeded_once", "metric_points", "metric_points_missing", "metric_points_twice"]
    keys += ["log_lines", "log_lines_missing", "log_lines_extra"]
    return {
        "jobs_per_run": args.jobs,
        "outage_s": args.outage_s,
        "faults_mid_run": sum(r["reached_mid_run"] for r in runs),
        **{k if k.startswith(("metric", "log")) else f"jobs_{k}": total(runs, k) for k in keys},
    }


# broker-restart -------------------------------------------------------------------------------------------------


def broker_restart_run(settings: Settings, redis: PrivateRedis, spec: dict[str, Any], args: argparse.Namespace) -> dict:
    ids = [sched.submit(settings, spec)]
    reached = settle(lambda: running(settings, ids), 600)
    redis.stop()  # every message it held is gone (no persistence)
    ids += [sched.submit(settings, spec) for _ in range(args.jobs)]  # committed; their messages wait
    time.sleep(args.outage_s)
    redis.start()
    back = utcnow()
    settle(lambda: finished(settings, ids), 900)
    return {"reached_mid_run": reached and ended_after(settings, ids[:1], back), **job_counts(settings, ids)}


def broker_restart(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    with private_redis() as redis:
        settings = isolated_settings(root / "var", broker_url=redis.url, **FAST)
        data = sched.tiny_data(settings)
        spec = sched.train_spec(data, train_iters=args.iters, resources={"nproc_per_node": 1})
        with sched.reconciler(settings), sched.running_worker(settings, "h1", args.jobs + 1, root / "worker.log"):
            runs = [broker_restart_run(settings, redis, spec, args) for _ in range(args.runs)]
    return {
        "jobs_per_run": args.jobs + 1,
        "outage_s": args.outage_s,
        "faults_mid_run": sum(r["reached_mid_run"] for r in runs),
        **{f"jobs_{k}": total(runs, k) for k in ("lost", "run_twice", "succeeded_once")},
    }


FAULTS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "worker-kill": worker_kill,
    "replica-kill": replica_kill,
    "db-restart": db_restart,
    "broker-restart": broker_restart,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--fault", choices=sorted(FAULTS), default="worker-kill")
    parser.add_argument("--runs", type=int, default=2, help="faults injected (default 2)")
    parser.add_argument("--iters", type=int, default=40, help="train iterations of a job (worker-kill, *-restart)")
    parser.add_argument("--save-interval", type=int, default=10, help="worker-kill: checkpoint interval")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="worker-kill: relative loss difference")
    parser.add_argument("--jobs", type=int, default=2, help="jobs per run (replica-kill: default 2 is small; try 12)")
    parser.add_argument("--outage-s", type=float, default=5.0, help="db-restart, broker-restart: seconds stopped")
    parser.add_argument("--smoke", action="store_true", help="worker-kill once, 30 iterations: the same code path")
    args = parser.parse_args()
    if args.smoke:
        # 30, not 10: the tiny job ran all 10 before the kill landed (its first checkpoint is seen ~1 s late), so the
        # resumed attempt trained nothing and reported no final loss (final_lm_losses [null]); 30 costs no more wall
        args.fault, args.runs, args.iters, args.save_interval = "worker-kill", 1, 30, 5
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmjobs-faults-") as tmp:
        figures = FAULTS[args.fault](args, Path(tmp))
    print(
        json.dumps(
            {
                "bench": "faults",
                "smoke": args.smoke,
                "fault": args.fault,
                "runs": args.runs,
                **figures,
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
