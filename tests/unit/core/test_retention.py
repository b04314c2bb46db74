"""Retention: finished jobs lose metric points, log lines, events and run directories after their configured days,
long metric histories are thinned, nothing of running or recent jobs is touched, events not yet fanned out to a
webhook stay; ``llmjobs gc`` applies the same pass."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select, update
from typer.testing import CliRunner

from cli.main import cli
from core.db import session_scope
from core.jobs import add_event
from core.models import Event, Job, LogLine, MetricPoint, Webhook, utcnow
from core.retention import collect, keep_indices
from core.settings import Settings, clear_settings
from core_support import isolated_settings, make_job

DAYS = {
    "retention_metric_points_days": 1,
    "retention_log_lines_days": 1,
    "retention_events_days": 1,
    "retention_run_dirs_days": 1,
    "metric_downsample_above": 10,
}


def job_with_records(settings: Settings, state: str, finished_days_ago: float | None, points: int = 5) -> str:
    job_id = make_job(settings)
    finished = utcnow() - timedelta(days=finished_days_ago) if finished_days_ago is not None else None
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(state=state, finished_at=finished))
        session.add_all(
            MetricPoint(job_id=job_id, step=s, name="lm_loss", value=1.0 / (s + 1), rank=0) for s in range(points)
        )
        session.add_all(LogLine(job_id=job_id, stream="rank0", seq=s, text=f"line {s}") for s in range(3))
        add_event(session, job_id, "progress", "half way")
    run_dir = settings.runs_path / job_id
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    return job_id


def counts(settings: Settings, job_id: str) -> tuple[int, int, int, bool]:
    with session_scope(settings.database_url) as session:
        found = tuple(
            int(session.scalar(select(func.count()).select_from(model).where(model.job_id == job_id)) or 0)
            for model in (MetricPoint, LogLine, Event)
        )
    return (*found, (settings.runs_path / job_id).exists())  # type: ignore[return-value]


def test_old_finished_jobs_lose_their_records_and_long_histories_are_thinned(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, **DAYS)
    old = job_with_records(settings, "succeeded", 2)
    recent = job_with_records(settings, "failed", 0.1)
    running = job_with_records(settings, "running", None, points=50)
    long = job_with_records(settings, "succeeded", 0.1, points=100)
    done = collect(settings)
    assert counts(settings, old) == (0, 0, 0, False)
    assert counts(settings, recent) == (5, 3, 2, True)
    assert counts(settings, running) == (50, 3, 2, True)  # live history is never thinned
    with session_scope(settings.database_url) as session:
        steps = list(
            session.scalars(select(MetricPoint.step).where(MetricPoint.job_id == long).order_by(MetricPoint.step))
        )
    assert steps[0] == 0 and steps[-1] == 99 and 8 <= len(steps) <= 12  # evenly thinned, ends kept
    assert done.as_dict() == {
        "metric_points": 5,
        "log_lines": 3,
        "events": 2,
        "run_dirs": 1,
        "downsampled_points": 100 - len(steps),
    }
    assert not any(collect(settings).as_dict().values())  # idempotent


def test_events_not_yet_sent_to_a_webhook_stay(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, **DAYS)
    old = job_with_records(settings, "succeeded", 2)
    with session_scope(settings.database_url) as session:
        first = session.scalar(select(func.min(Event.id)).where(Event.job_id == old))
        session.add(Webhook(team="t", url="https://example.com/h", events=["job.succeeded"], secret="s", cursor=first))
    collect(settings)
    assert counts(settings, old)[2] == 1  # the one the webhook's cursor has passed is gone, the next stays


def test_gc_command_runs_the_pass(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, **DAYS)
    old = job_with_records(settings, "cancelled", 3)
    env = {
        "LLMJOBS_VAR_DIR": str(tmp_path),
        "LLMJOBS_DATABASE_URL": settings.database_url,
        **{f"LLMJOBS_{k.upper()}": str(v) for k, v in DAYS.items()},
    }
    try:
        result = CliRunner().invoke(cli, ["gc"], env=env)
    finally:
        clear_settings()  # the command cached settings of this test's environment
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["metric_points"] == 5
    assert counts(settings, old) == (0, 0, 0, False)


def test_keep_indices() -> None:
    assert keep_indices(5, 10) == set(range(5))
    kept = keep_indices(1000, 100)
    assert {0, 999} <= kept and 90 <= len(kept) <= 101
