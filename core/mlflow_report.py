"""``report_to: ["mlflow"]``: the service mirrors a train job to an existing MLflow tracking server as it runs.

The leader's loop (``core.background_loops``) calls ``report_once``: for each such job it makes the remote run (in
``mlflow_experiment``, else the job's ``metadata.experiment``, else its team), sends the spec's fields as params, the
job-wide metric points (as the worker ingested them) after the last one sent, up to 1,000 a ``log-batch``, and at the
end the final state. Where it stands is a ``mlflow_reports`` row, so a restarted or new leader picks up from there.
Nothing here touches the job: a server that is down, slow or refusing costs one warning event per outage and a
backoff (doubling to 5 minutes), never the training; the URL is checked like a webhook's (``core.net_guard``).
The bearer token is the team secret the spec names (``mlflow_token_secret``, ``core.team_secrets``): opened here, for
the requests of one pass, and sent nowhere else (the job's row, its spec and the worker never hold it).
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from core import net_guard, team_secrets
from core.db import session_scope
from core.jobs import add_event
from core.mlflow_jobs import experiment_of, flatten, millis
from core.models import Job, MetricPoint, MlflowReport, utcnow
from core.settings import Settings
from core.states import TERMINAL

log = logging.getLogger(__name__)
INTERVAL_S = 5.0  # between passes of the leader's loop
TIMEOUT_S = 20.0  # one request; a hung server holds this loop (only this one) no longer than this per job
BATCH_METRICS, BATCH_PARAMS = 1000, 100  # MLflow's log-batch limits
BATCHES_PER_PASS = 20  # per job: a long backlog drains over several passes, other jobs get their turn
MAX_BACKOFF_S = 300.0
GIVE_UP_AFTER = 30  # failures in a row of a finished job: its mirror stops, with a last warning
FINAL_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
RECENT = timedelta(days=1)  # jobs finished longer ago than this are no longer picked up


class Unreachable(Exception):
    """The tracking server did not take a request (connection, timeout, an error status, a blocked URL)."""


class Tracker:
    """The few MLflow REST calls the mirror makes, each to the address ``core.net_guard`` checked just now."""

    def __init__(self, settings: Settings, base_url: str, token: str | None = None):
        self.settings, self.base = settings, base_url.rstrip("/")
        self.auth = {"authorization": f"Bearer {token}"} if token else {}

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            target = net_guard.pin(f"{self.base}/api/2.0/mlflow/{path}", self.settings)
        except net_guard.Blocked as err:
            raise Unreachable(f"mlflow_tracking_uri: {err}") from err
        try:
            with httpx.Client(timeout=TIMEOUT_S, follow_redirects=False, trust_env=False) as client:
                answer = client.request(
                    method,
                    target.url,
                    json=body if method == "POST" else None,
                    params=body if method == "GET" else None,
                    headers={"host": target.host_header, **self.auth},
                    extensions={"sni_hostname": target.host},
                )
        except httpx.HTTPError as err:
            raise Unreachable(f"{type(err).__name__}: {err}") from err
        if answer.status_code == 404 and path == "experiments/get-by-name":
            return {}
        if answer.status_code >= 400:
            raise Unreachable(f"{path} answered {answer.status_code}: {answer.text[:200]}")
        result: dict[str, Any] = answer.json()
        return result

    def experiment_id(self, name: str) -> str:
        found = self.call("GET", "experiments/get-by-name", {"experiment_name": name})
        if found:
            return str(found["experiment"]["experiment_id"])
        return str(self.call("POST", "experiments/create", {"name": name})["experiment_id"])


def _value(value: float | None) -> float | str:
    if value is None or math.isnan(value):
        return "NaN"  # the store keeps non-finite points as NULL
    return value if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")


def _start(tracker: Tracker, job: Job) -> str:
    spec = job.spec or {}
    experiment = spec.get("mlflow_experiment") or experiment_of(job, job.team)
    tags = {
        "mlflow.runName": job.name or job.id,
        "mlflow.source.name": "llmjobs",
        "mlflow.source.type": "JOB",
        "llmjobs.job_id": job.id,
        "llmjobs.team": job.team,
        **{k: str(v) for k, v in (job.meta or {}).items()},
    }
    body = {
        "experiment_id": tracker.experiment_id(str(experiment)),
        "run_name": job.name or job.id,
        "start_time": millis(job.started_at or job.created_at),
        "tags": [{"key": k, "value": v} for k, v in tags.items()],
    }
    return str(tracker.call("POST", "runs/create", body)["run"]["info"]["run_id"])


def _send(session: Session, tracker: Tracker, job: Job, report: MlflowReport) -> None:
    """Whatever of the job the server has not got yet; the report row moves after each request that worked."""
    if report.remote_run_id is None:
        report.remote_run_id = _start(tracker, job)
        session.commit()
    run_id = report.remote_run_id
    if not report.params_sent:
        params = [{"key": k, "value": v[:6000]} for k, v in flatten({**(job.spec or {}), "metadata": None})]
        for at in range(0, len(params), BATCH_PARAMS):
            tracker.call("POST", "runs/log-batch", {"run_id": run_id, "params": params[at : at + BATCH_PARAMS]})
        report.params_sent = True
        session.commit()
    finished = job.state in FINAL_STATUS
    for _ in range(BATCHES_PER_PASS):
        points = list(
            session.scalars(
                select(MetricPoint)
                .where(MetricPoint.job_id == job.id, MetricPoint.rank.is_(None), MetricPoint.id > report.cursor)
                .order_by(MetricPoint.id)
                .limit(BATCH_METRICS)
            )
        )
        if not points:
            break
        metrics = [
            {"key": p.name, "value": _value(p.value), "timestamp": millis(p.time), "step": p.step} for p in points
        ]
        tracker.call("POST", "runs/log-batch", {"run_id": run_id, "metrics": metrics})
        report.cursor = points[-1].id
        session.commit()
    else:
        finished = False  # more points wait: the final state goes after them, in a later pass
    if finished:
        end = millis(job.finished_at) or millis(utcnow())
        tracker.call("POST", "runs/update", {"run_id": run_id, "status": FINAL_STATUS[job.state], "end_time": end})
        report.finished = True
        session.commit()


def _failed(session: Session, job: Job, report: MlflowReport, err: Exception, now: datetime) -> None:
    session.rollback()  # a half-sent pass: the report row keeps what was acknowledged
    report.failures += 1
    report.last_error = str(err)[:1000]
    report.next_try_at = now + timedelta(seconds=min(2.0**report.failures, MAX_BACKOFF_S))
    blocked = str(err).startswith("mlflow_tracking_uri:")
    give_up = blocked or (job.state in FINAL_STATUS and report.failures >= GIVE_UP_AFTER)
    if report.failures == 1 or give_up:  # one warning per outage, and one when the mirror stops
        then = "the mirror stops" if give_up else "the job goes on; retrying with backoff"
        message = f"report_to mlflow: {job.spec.get('mlflow_tracking_uri')} did not take the job's data ({err}); {then}"
        add_event(session, job.id, "warning", message[:2000], level="warning", data={"report_to": "mlflow"})
    report.finished = report.finished or give_up
    session.commit()
    log.warning("mlflow report of job %s failed (%d in a row): %s", job.id, report.failures, err)


def reporting_jobs(session: Session, now: datetime) -> list[Job]:
    """Train jobs asking for report_to mlflow whose mirror is not finished: live ones, and those finished lately."""
    done = select(MlflowReport.job_id).where(MlflowReport.finished.is_(True))
    query = select(Job).where(
        Job.kind == "train",
        Job.spec["report_to"].as_string().contains("mlflow"),
        Job.id.not_in(done),
        or_(Job.state.not_in([s.value for s in TERMINAL]), Job.finished_at >= now - RECENT),
    )
    return list(session.scalars(query.order_by(Job.created_at)))


def tracker(session: Session, settings: Settings, job: Job) -> Tracker:
    """The job's tracking server, with the token of the team secret its spec names (opened now)."""
    secret = job.spec.get("mlflow_token_secret")
    token = team_secrets.reveal(session, settings, job.team, str(secret)) if secret else None
    return Tracker(settings, str(job.spec["mlflow_tracking_uri"]), token)


def report_once(settings: Settings) -> int:
    """One pass over the jobs to mirror; returns how many were sent to without an error."""
    sent = 0
    now = utcnow()
    with session_scope(settings.database_url) as session:
        for job in reporting_jobs(session, now):
            report = session.get(MlflowReport, job.id)
            if report is None:
                report = MlflowReport(job_id=job.id, cursor=0, failures=0, params_sent=False, finished=False)
                session.add(report)
                session.commit()
            if report.next_try_at is not None and report.next_try_at > now:
                continue
            try:
                _send(session, tracker(session, settings, job), job, report)
            except (Unreachable, KeyError, ValueError) as err:
                _failed(session, job, report, err, now)
                continue
            if report.failures:
                report.failures, report.next_try_at, report.last_error = 0, None, None
                session.commit()
            sent += 1
    return sent
