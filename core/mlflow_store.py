"""The MLflow tracking store behind /api/2.0/mlflow/ (``app.api.mlflow``): one team's experiments and runs.

Runs are of two sorts: jobs (``core.mlflow_jobs``: read-only views of the job's own rows) and runs a notebook logs
through the API (``mlflow_runs`` and their params, tags, metric points). Experiments are rows either way: the names
the team's jobs carry become rows the first time the API reads the team's experiments. Every lookup is by team, so a
token of another team finds nothing (``RESOURCE_DOES_NOT_EXIST``, as if it did not exist).
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.mlflow_errors import MlflowError
from core.mlflow_jobs import CHUNK, experiment_names, experiment_of, in_experiment, job_views, millis, point_json
from core.mlflow_search import RunView, parse_filter, parse_order_by, search
from core.models import Job, MetricPoint, MlflowExperiment, MlflowMetric, MlflowParam, MlflowRun, MlflowTag
from core.records import redone

DEFAULT_EXPERIMENT_ID = "0"  # what a client that never set an experiment sends: the team's default
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # one log-batch request (MLflow's limits)
MAX_KEY, MAX_PARAM_VALUE, MAX_TAG_VALUE = 250, 6000, 8000
MAX_SEARCH_RESULTS, MAX_HISTORY_RESULTS = 50000, 25000
_KEY_CHARS = re.compile(r"^[\w\-./ :]+$")
_STATUSES = {"RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED"}


@dataclass(frozen=True)
class Point:
    key: str
    value: float
    timestamp: int
    step: int


def now_ms() -> int:
    return int(time.time() * 1000)


# --- experiments -------------------------------------------------------------------------------------------------


def experiment_json(exp: MlflowExperiment) -> dict[str, Any]:
    return {
        "experiment_id": str(exp.id),
        "name": exp.name,
        "artifact_location": exp.artifact_location,
        "lifecycle_stage": exp.lifecycle_stage,
        "creation_time": millis(exp.created_at),
        "last_update_time": millis(exp.updated_at),
        "tags": [{"key": k, "value": v} for k, v in sorted((exp.tags or {}).items())],
    }


def sync_job_experiments(session: Session, team: str) -> None:
    """Make a row of every experiment the team's jobs name (and the team's default) that has none yet."""
    have = set(session.scalars(select(MlflowExperiment.name).where(MlflowExperiment.team == team)))
    for name in sorted(experiment_names(session, team) - have):
        try:
            _insert_experiment(session, team, name, {})
            session.commit()
        except IntegrityError:  # another request inserted the same name first: keep theirs
            session.rollback()


def _insert_experiment(session: Session, team: str, name: str, tags: dict[str, str]) -> MlflowExperiment:
    exp = MlflowExperiment(team=team, name=name, tags=tags)
    session.add(exp)
    session.flush()
    exp.artifact_location = f"mlflow-artifacts:/{exp.id}"
    return exp


def experiment_by_name(session: Session, team: str, name: str) -> MlflowExperiment:
    sync_job_experiments(session, team)
    exp = session.scalar(select(MlflowExperiment).where(MlflowExperiment.team == team, MlflowExperiment.name == name))
    if exp is None:
        raise MlflowError(f"Could not find experiment with name '{name}'", code="RESOURCE_DOES_NOT_EXIST")
    return exp


def experiment_by_id(session: Session, team: str, experiment_id: str) -> MlflowExperiment:
    if experiment_id == DEFAULT_EXPERIMENT_ID:
        return experiment_by_name(session, team, team)
    exp = session.get(MlflowExperiment, int(experiment_id)) if experiment_id.isdigit() else None
    if exp is None or exp.team != team:
        raise MlflowError(f"No Experiment with id={experiment_id} exists", code="RESOURCE_DOES_NOT_EXIST")
    return exp


def create_experiment(session: Session, team: str, name: str, tags: dict[str, str]) -> MlflowExperiment:
    name = name.strip()
    if not name:
        raise MlflowError("Invalid experiment name: ''. 'name' must be a non-empty string.")
    if len(name) > 500:
        raise MlflowError("experiment name: at most 500 characters")
    sync_job_experiments(session, team)
    try:
        exp = _insert_experiment(session, team, name, tags)
        session.commit()
    except IntegrityError:
        session.rollback()
        raise MlflowError(f"Experiment(name={name}) already exists.", code="RESOURCE_ALREADY_EXISTS") from None
    return exp


def search_experiments(
    session: Session, team: str, max_results: int, page_token: str | None
) -> tuple[list, str | None]:
    sync_job_experiments(session, team)
    offset = _offset(page_token)
    rows = list(
        session.scalars(
            select(MlflowExperiment)
            .where(MlflowExperiment.team == team)
            .order_by(MlflowExperiment.id)
            .offset(offset)
            .limit(max_results + 1)
        )
    )
    token = _token(offset + max_results) if len(rows) > max_results else None
    return [experiment_json(e) for e in rows[:max_results]], token


# --- runs ---------------------------------------------------------------------------------------------------------


def _notebook_run(session: Session, team: str, run_id: str) -> MlflowRun | None:
    run = session.get(MlflowRun, run_id) if len(run_id) <= 32 else None
    return run if run is not None and run.team == team else None


def _job(session: Session, team: str, run_id: str) -> Job | None:
    job = session.get(Job, run_id) if len(run_id) <= 36 else None
    return job if job is not None and job.team == team else None


def _missing_run(run_id: str) -> MlflowError:
    return MlflowError(f"Run with id={run_id} not found", code="RESOURCE_DOES_NOT_EXIST")


def writable_run(session: Session, team: str, run_id: str) -> MlflowRun:
    run = _notebook_run(session, team, run_id)
    if run is not None:
        return run
    if _job(session, team, run_id) is not None:
        raise MlflowError(
            f"run {run_id} is a job of the service: its params, metrics and tags come from the job and cannot be "
            "logged here",
            code="PERMISSION_DENIED",
        )
    raise _missing_run(run_id)


def create_run(
    session: Session,
    team: str,
    experiment_id: str,
    run_name: str | None,
    user_id: str | None,
    start_time: int | None,
    tags: dict[str, str],
) -> str:
    exp = experiment_by_id(session, team, experiment_id or DEFAULT_EXPERIMENT_ID)
    run_id = uuid.uuid4().hex
    name = run_name or tags.get("mlflow.runName") or f"run-{run_id[:8]}"
    _check_tags(tags)
    run = MlflowRun(
        id=run_id,
        team=team,
        experiment_id=exp.id,
        name=name[:250],
        user_id=(user_id or "")[:250],
        start_time=start_time or now_ms(),
    )
    session.add(run)
    session.flush()
    session.add_all(MlflowTag(run_id=run_id, key=k, value=v) for k, v in {**tags, "mlflow.runName": name}.items())
    session.commit()
    return run_id


def update_run(
    session: Session, team: str, run_id: str, status: str | None, end_time: int | None, run_name: str | None
) -> dict[str, Any]:
    run = writable_run(session, team, run_id)
    if status is not None:
        if status not in _STATUSES:
            raise MlflowError(f"status: {status!r} is not one of {', '.join(sorted(_STATUSES))}")
        run.status = status
    if end_time is not None:
        run.end_time = end_time
    if run_name:
        run.name = run_name[:250]
        _set_tags(session, run_id, {"mlflow.runName": run.name})
    session.commit()
    return get_run(session, team, run_id)["info"]


def _check_key(key: str, what: str) -> None:
    if not key or len(key) > MAX_KEY or not _KEY_CHARS.match(key) or key.startswith("/") or ".." in key.split("/"):
        raise MlflowError(
            f"Invalid {what} name: {key!r}. Names may be at most {MAX_KEY} characters of letters, digits, "
            "underscores, dashes, periods, spaces, colons and slashes."
        )


def _check_tags(tags: dict[str, str]) -> None:
    for key, value in tags.items():
        _check_key(key, "tag")
        if len(value) > MAX_TAG_VALUE:
            raise MlflowError(f"Tag value of '{key}' is longer than {MAX_TAG_VALUE} characters")


def _set_tags(session: Session, run_id: str, tags: dict[str, str]) -> None:
    if tags:  # last write wins
        session.execute(delete(MlflowTag).where(MlflowTag.run_id == run_id, MlflowTag.key.in_(list(tags))))
        session.add_all(MlflowTag(run_id=run_id, key=k, value=v) for k, v in tags.items())


def log_batch(
    session: Session,
    team: str,
    run_id: str,
    metrics: list[Point],
    params: list[tuple[str, str]],
    tags: list[tuple[str, str]],
) -> None:
    """Metrics append, params are written once (the same value again is fine), tags are last-write-wins."""
    for items, limit, what in (
        (metrics, MAX_METRICS, "metrics"),
        (params, MAX_PARAMS, "params"),
        (tags, MAX_TAGS, "tags"),
    ):
        if len(items) > limit:
            raise MlflowError(f"A batch logging request can contain at most {limit} {what}. Got {len(items)} {what}.")
    run = writable_run(session, team, run_id)
    wanted: dict[str, str] = {}
    for key, value in params:
        _check_key(key, "parameter")
        if len(value) > MAX_PARAM_VALUE:
            raise MlflowError(f"Param value of '{key}' is longer than {MAX_PARAM_VALUE} characters")
        if wanted.setdefault(key, value) != value:
            raise MlflowError(f"Duplicate parameter keys with different values in one batch: {key!r}")
    stored = dict(
        session.execute(
            select(MlflowParam.key, MlflowParam.value).where(
                MlflowParam.run_id == run.id, MlflowParam.key.in_(list(wanted))
            )
        )
        .tuples()
        .all()
    )
    for key, value in wanted.items():
        if key in stored and stored[key] != value:
            raise MlflowError(
                f"Changing param values is not allowed. Param with key='{key}' was already logged with "
                f"value='{stored[key]}' for run ID='{run.id}'. Attempted logging new value '{value}'."
            )
    new_tags = dict(tags)
    _check_tags(new_tags)
    for point in metrics:
        _check_key(point.key, "metric")
    session.add_all(MlflowParam(run_id=run.id, key=k, value=v) for k, v in wanted.items() if k not in stored)
    _set_tags(session, run.id, new_tags)
    if "mlflow.runName" in new_tags:
        run.name = new_tags["mlflow.runName"][:250]
    session.add_all(_metric_row(run.id, p) for p in metrics)
    session.commit()


def delete_tag(session: Session, team: str, run_id: str, key: str) -> None:
    run = writable_run(session, team, run_id)
    gone = session.execute(delete(MlflowTag).where(MlflowTag.run_id == run.id, MlflowTag.key == key))
    if not gone.rowcount:  # type: ignore[attr-defined]
        raise MlflowError(f"No tag with name: {key} in run with id {run_id}", code="RESOURCE_DOES_NOT_EXIST")
    session.commit()


def _metric_row(run_id: str, point: Point) -> MlflowMetric:
    value: float | None = point.value
    special = None
    if not math.isfinite(point.value):  # SQLite keeps no NaN: the name of the value instead
        value, special = None, "NaN" if math.isnan(point.value) else "Infinity" if point.value > 0 else "-Infinity"
    return MlflowMetric(
        run_id=run_id, key=point.key, value=value, special=special, timestamp=point.timestamp, step=point.step
    )


def _notebook_views(session: Session, runs: list[MlflowRun]) -> list[RunView]:
    ids = [r.id for r in runs]
    params: dict[str, dict[str, str]] = {}
    tags: dict[str, dict[str, str]] = {}
    latest: dict[str, list[MlflowMetric]] = {}
    for at in range(0, len(ids), CHUNK):
        chunk = ids[at : at + CHUNK]
        for p in session.scalars(select(MlflowParam).where(MlflowParam.run_id.in_(chunk))):
            params.setdefault(p.run_id, {})[p.key] = p.value
        for t in session.scalars(select(MlflowTag).where(MlflowTag.run_id.in_(chunk))):
            tags.setdefault(t.run_id, {})[t.key] = t.value
        newest = (
            select(func.max(MlflowMetric.id))
            .where(MlflowMetric.run_id.in_(chunk))
            .group_by(MlflowMetric.run_id, MlflowMetric.key)
        )
        for m in session.scalars(select(MlflowMetric).where(MlflowMetric.id.in_(newest))):
            latest.setdefault(m.run_id, []).append(m)
    views = []
    for run in runs:
        points = sorted(latest.get(run.id, []), key=lambda m: m.key)
        attributes = {
            "run_id": run.id,
            "run_uuid": run.id,
            "run_name": run.name,
            "experiment_id": str(run.experiment_id),
            "user_id": run.user_id,
            "status": run.status,
            "start_time": run.start_time,
            "end_time": run.end_time,
            "artifact_uri": f"mlflow-artifacts:/{run.experiment_id}/{run.id}/artifacts",
            "lifecycle_stage": run.lifecycle_stage,
        }
        views.append(
            RunView(
                attributes={k: v for k, v in attributes.items() if v is not None},
                metrics={m.key: float(m.special) if m.value is None else m.value for m in points},  # type: ignore[arg-type]
                params=params.get(run.id, {}),
                tags=tags.get(run.id, {}),
                metric_json=[point_json(m.key, m.value, m.timestamp, m.step, m.special) for m in points],
            )
        )
    return views


def run_json(view: RunView) -> dict[str, Any]:
    return {
        "info": view.attributes,
        "data": {
            "metrics": view.metric_json,
            "params": [{"key": k, "value": v} for k, v in sorted(view.params.items())],
            "tags": [{"key": k, "value": v} for k, v in sorted(view.tags.items())],
        },
        "inputs": {},
    }


def _job_experiment_ids(session: Session, team: str, jobs: list[Job]) -> dict[str, str]:
    names = {experiment_of(job, team) for job in jobs}
    sync_job_experiments(session, team)
    rows = (
        session.execute(
            select(MlflowExperiment.name, MlflowExperiment.id).where(
                MlflowExperiment.team == team, MlflowExperiment.name.in_(names)
            )
        )
        .tuples()
        .all()
    )
    return {name: str(exp_id) for name, exp_id in rows}


def get_run(session: Session, team: str, run_id: str) -> dict[str, Any]:
    run = _notebook_run(session, team, run_id)
    if run is not None:
        return run_json(_notebook_views(session, [run])[0])
    job = _job(session, team, run_id)
    if job is None:
        raise _missing_run(run_id)
    return run_json(job_views(session, team, [job], _job_experiment_ids(session, team, [job]))[0])


def search_runs(
    session: Session,
    team: str,
    experiment_ids: list[str],
    filter_string: str | None,
    order_by: list[str],
    max_results: int,
    page_token: str | None,
    run_view_type: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Runs of the team's experiments among ``experiment_ids`` (others' ids find nothing), filtered and ordered in
    memory (``core.mlflow_search``) and paged by offset."""
    if not 1 <= max_results <= MAX_SEARCH_RESULTS:
        raise MlflowError(f"Invalid value {max_results} for parameter 'max_results': 1 to {MAX_SEARCH_RESULTS}")
    clauses, order, offset = parse_filter(filter_string), parse_order_by(order_by), _offset(page_token)
    if run_view_type == "DELETED_ONLY":
        return [], None
    sync_job_experiments(session, team)
    ids = [int(i) for i in experiment_ids if i.isdigit() and i != DEFAULT_EXPERIMENT_ID]
    if DEFAULT_EXPERIMENT_ID in experiment_ids:
        ids.append(experiment_by_name(session, team, team).id)
    experiments = list(
        session.scalars(select(MlflowExperiment).where(MlflowExperiment.team == team, MlflowExperiment.id.in_(ids)))
    )
    runs = list(session.scalars(select(MlflowRun).where(MlflowRun.team == team, MlflowRun.experiment_id.in_(ids))))
    views = _notebook_views(session, runs)
    if experiments:
        grouped: list[ColumnElement[bool]] = [in_experiment(e.name, team) for e in experiments]
        jobs = list(session.scalars(select(Job).where(Job.team == team, or_(*grouped))))
        views += job_views(session, team, jobs, {e.name: str(e.id) for e in experiments})
    found = search(views, clauses, order)
    page = found[offset : offset + max_results]
    token = _token(offset + max_results) if len(found) > offset + max_results else None
    return [run_json(v) for v in page], token


# --- metric history -----------------------------------------------------------------------------------------------


def metric_history(
    session: Session, team: str, run_id: str, key: str, max_results: int, page_token: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Every point of one metric in (step, id) order, ``max_results`` a page; the token is the last (step, id)."""
    max_results = min(max(max_results, 1), MAX_HISTORY_RESULTS)
    after = _history_cursor(page_token)
    if (run := _notebook_run(session, team, run_id)) is not None:
        query = select(MlflowMetric).where(MlflowMetric.run_id == run.id, MlflowMetric.key == key)
        if after:
            query = query.where(_past(MlflowMetric.step, MlflowMetric.id, after))
        rows = list(session.scalars(query.order_by(MlflowMetric.step, MlflowMetric.id).limit(max_results + 1)))
        points = [point_json(m.key, m.value, m.timestamp, m.step, m.special) for m in rows[:max_results]]
        cursors = [(m.step, m.id) for m in rows]
    elif (job := _job(session, team, run_id)) is not None:
        jquery = select(MetricPoint).where(
            MetricPoint.job_id == job.id, MetricPoint.name == key, MetricPoint.rank.is_(None), ~redone(MetricPoint)
        )
        if after:
            jquery = jquery.where(_past(MetricPoint.step, MetricPoint.id, after))
        found = list(session.scalars(jquery.order_by(MetricPoint.step, MetricPoint.id).limit(max_results + 1)))
        points = [point_json(p.name, p.value, millis(p.time) or 0, p.step) for p in found[:max_results]]
        cursors = [(p.step, p.id) for p in found]
    else:
        raise _missing_run(run_id)
    more = len(cursors) > max_results
    token = _token("{}:{}".format(*cursors[max_results - 1])) if more else None
    return points, token


def _past(step: Any, row_id: Any, after: tuple[int, int]) -> ColumnElement[bool]:
    return or_(step > after[0], and_(step == after[0], row_id > after[1]))


# --- page tokens: opaque to the client ----------------------------------------------------------------------------


def _token(value: int | str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"at": value}).encode()).decode()


def _read_token(token: str) -> Any:
    try:
        return json.loads(base64.urlsafe_b64decode(token.encode()))["at"]
    except (ValueError, KeyError, TypeError):
        raise MlflowError(f"Invalid page token {token[:40]!r}") from None


def _offset(token: str | None) -> int:
    if not token:
        return 0
    value = _read_token(token)
    if not isinstance(value, int) or value < 0:
        raise MlflowError(f"Invalid page token {token[:40]!r}")
    return value


def _history_cursor(token: str | None) -> tuple[int, int] | None:
    if not token:
        return None
    value = _read_token(token)
    step, _, row_id = str(value).partition(":")
    if not (step.lstrip("-").isdigit() and row_id.isdigit()):
        raise MlflowError(f"Invalid page token {token[:40]!r}")
    return int(step), int(row_id)
