"""What a job produced: events, metric points, log lines, artifacts, and the live SSE stream of all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Header, Query, Request
from pydantic import BaseModel, Field

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.api.jobs import ERRORS
from app.input_guard import INT32_MAX, INT64_MAX
from app.schemas import (
    ArtifactPublic,
    CheckpointPublic,
    EventPublic,
    JobLatest,
    JobLatestList,
    ListPage,
    LogLinePublic,
    LogsPage,
    MetricPointPublic,
    MetricsPage,
)
from app.stream import Cursor, StreamResponse, job_stream
from core import checkpoints, records
from core.downloads import is_real
from core.errors import ApiError
from core.jobs import get_visible_job

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["observe"])
latest_router = APIRouter(prefix="/v1", tags=["observe"])


@router.get("/events", response_model=ListPage[EventPublic], responses=ERRORS)
def list_events(
    job_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[int, Query(ge=0, le=INT64_MAX, description="last_id of the previous page")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    type: Annotated[
        str | None, Query(max_length=200, description="only these event types, comma-separated, e.g. state,checkpoint")
    ] = None,
) -> ListPage[EventPublic]:
    """State changes and engine events (started, progress, checkpoint, config, warning, error, finished), oldest first."""
    get_visible_job(session, job_id, principal)
    types = [t.strip() for t in type.split(",") if t.strip()] if type else None
    rows, has_more = records.events_page(session, job_id, after=after, limit=limit, types=types)
    return ListPage[EventPublic].of([EventPublic.model_validate(r) for r in rows], has_more)


@router.get("/metrics", response_model=MetricsPage, responses=ERRORS)
def list_metrics(
    job_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    since_step: Annotated[int, Query(ge=-1, le=INT32_MAX, description="only steps after this one")] = -1,
    names: Annotated[str | None, Query(description="comma-separated metric names, e.g. lm_loss,grad_norm")] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    after: Annotated[str | None, Query(max_length=50, description="next_cursor of the previous page")] = None,
) -> MetricsPage:
    """Metric points by step (job-wide values have rank null, per-rank values carry their rank), each with the
    attempt that measured it; a step a retry did again appears once, as its latest attempt measured it. Page with
    ``after=<next_cursor>``: no point is skipped or repeated, whatever the limit."""
    get_visible_job(session, job_id, principal)
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else None
    rows, has_more = records.metrics_page(
        session, job_id, since_step=since_step, names=wanted, limit=limit, after=_metric_cursor(after)
    )
    attempts = records.point_attempts(session, job_id, rows)
    data = [
        MetricPointPublic.model_validate(r).model_copy(update={"attempt": a})
        for r, a in zip(rows, attempts, strict=True)
    ]
    cursor = f"{rows[-1].step}:{rows[-1].id}" if rows else after
    return MetricsPage(
        data=data, has_more=has_more, next_since_step=data[-1].step if data else None, next_cursor=cursor
    )


def _metric_cursor(after: str | None) -> tuple[int, int] | None:
    if after is None:
        return None
    step, _, point_id = after.partition(":")
    if not (step.isdigit() and point_id.isdigit()) or int(step) > INT32_MAX or int(point_id) > INT64_MAX:
        raise ApiError(400, "invalid_cursor", f"after: {after!r} is not a next_cursor of this endpoint", "after")
    return int(step), int(point_id)


class CompletionRow(BaseModel):
    """One completion of a stage grpo rollout, as the engine wrote it to the run's completions.jsonl."""

    iteration: int = Field(description="the first iteration that trained on its rollout")
    prompt_id: int = Field(description="the dataset row of its prompt")
    prompt_ids: list[int]
    prompt: str | None = Field(None, description="the prompt's text as the model saw it (its chat template included)")
    completion_ids: list[int] = Field(description="the token ids the loss saw (up to and including the stop token)")
    completion: str
    reward: float = Field(description="the weighted sum of the reward functions")
    rewards: dict[str, float | None] = Field(
        description="each reward function's score, by name; null where an http reward's batch failed (TRL's None)"
    )
    advantage: float
    truncated: bool = Field(description="cut at max_completion_length (no stop token)")


class CompletionsPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[CompletionRow]
    has_more: bool
    next_offset: int = Field(description="pass as offset for the next page")


@router.get("/completions", response_model=CompletionsPage, responses=ERRORS)
def list_completions(
    job_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    step: Annotated[
        int | None,
        Query(ge=1, le=INT32_MAX, description="only the rollout iteration step trained on (default: every rollout)"),
    ] = None,
    offset: Annotated[int, Query(ge=0, le=INT32_MAX, description="rows of the selection to skip")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> CompletionsPage:
    """A stage grpo job's completions (its run's completions.jsonl), oldest first; with ``step``, those of the
    rollout that iteration trained on (under num_iterations > 1 one rollout serves several iterations). Empty for
    any other job, or before its first rollout."""
    job = get_visible_job(session, job_id, principal)
    path = Path(job.run_dir) / "completions.jsonl"
    if not path.is_file():
        return CompletionsPage(data=[], has_more=False, next_offset=offset)
    selected: list[dict[str, Any]] = []  # the rows of the selection from offset on, one more than a page at most
    seen, made = 0, None
    with open(path, encoding="utf-8") as f:  # rows are in iteration order: read no further than needed
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if step is not None:
                if row["iteration"] > step:
                    break
                if row["iteration"] != made:  # a later rollout still at or before step: start over with it
                    made, seen, selected = row["iteration"], 0, []
            seen += 1
            if seen > offset:
                selected.append(row)
            if step is None and len(selected) > limit:
                break
    page = selected[:limit]
    return CompletionsPage(
        data=[CompletionRow.model_validate(r) for r in page],
        has_more=len(selected) > limit,
        next_offset=offset + len(page),
    )


@router.get("/logs", response_model=LogsPage, responses=ERRORS)
def list_logs(
    job_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    rank: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="a rank's own log (logs/rank{R}.log)")] = None,
    stream: Annotated[
        str | None, Query(max_length=32, description="'launcher' (default: every rank's output) or 'rank0', ...")
    ] = None,
    offset: Annotated[int, Query(ge=0, le=INT32_MAX, description="first line number to return")] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    q: Annotated[str | None, Query(max_length=200, description="only lines containing this text (any case)")] = None,
) -> LogsPage:
    """Log lines of one stream, from line ``offset`` on; with ``q``, the lines that contain it (search)."""
    get_visible_job(session, job_id, principal)
    if rank is not None and stream is not None:
        raise ApiError(400, "bad_request", "rank: give rank or stream, not both", "rank")
    name = f"rank{rank}" if rank is not None else (stream or "launcher")
    rows, has_more = records.logs_page(session, job_id, stream=name, offset=offset, limit=limit, q=q)
    data = [LogLinePublic.model_validate(r) for r in rows]
    return LogsPage(data=data, has_more=has_more, next_offset=data[-1].seq + 1 if data else offset)


@router.get("/artifacts", response_model=ListPage[ArtifactPublic], responses=ERRORS)
def list_artifacts(job_id: str, session: SessionDep, principal: PrincipalDep) -> ListPage[ArtifactPublic]:
    """The files and directories the job wrote (result.json ``outputs`` that are paths), with sizes and a download
    URL each."""
    get_visible_job(session, job_id, principal)
    rows = [r for r in records.artifacts(session, job_id) if is_real(r)]
    data = [ArtifactPublic.model_validate(r) for r in rows]
    for item in data:
        item.download_url = f"/v1/jobs/{job_id}/artifacts/{quote(item.name, safe='')}/download"
    return ListPage[ArtifactPublic](data=data, has_more=False)


@router.get(
    "/stream",
    responses={
        **ERRORS,
        200: {"content": {"text/event-stream": {}}, "description": "SSE: state, event, metric, log, end"},
        429: {"description": "The team has team_max_streams streams open (see Retry-After)"},
    },
)
def stream_job(
    job_id: str,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    last_event_id: Annotated[str | None, Header()] = None,
    after: Annotated[str | None, Query(description="a Last-Event-ID, for clients that cannot send the header")] = None,
) -> Any:
    """Server-Sent Events of everything the job records, until it ends. Resumes after Last-Event-ID. A team may hold
    ``team_max_streams`` open at once (429 with Retry-After past it)."""
    get_visible_job(session, job_id, principal)
    try:
        cursor = Cursor.parse(last_event_id or after)
    except ValueError as err:
        raise ApiError(400, "bad_request", f"Last-Event-ID: {err}", "Last-Event-ID") from err
    session.close()  # an open stream holds no database connection: each read takes a short one (app.stream.fetch)
    slots = request.app.state.streams
    slots.acquire(principal.team)
    return StreamResponse(job_stream(settings, job_id, cursor), lambda: slots.release(principal.team), ping=15)


@router.get("/checkpoints", response_model=ListPage[CheckpointPublic], responses=ERRORS)
def list_checkpoints(job_id: str, session: SessionDep, principal: PrincipalDep) -> ListPage[CheckpointPublic]:
    """A train job's checkpoints (periodic training states and the final export), oldest first, with the loss at
    each iteration; an eval or convert job may name one by path or as ``reference``."""
    job = get_visible_job(session, job_id, principal)
    data = [CheckpointPublic(**c) for c in checkpoints.list_checkpoints(session, job)]
    return ListPage[CheckpointPublic](data=data, has_more=False)


@latest_router.get("/metrics/latest", response_model=JobLatestList, responses=ERRORS)
def latest_metrics(
    session: SessionDep,
    principal: PrincipalDep,
    ids: Annotated[
        str,
        # Job ids are UUIDs: the pattern keeps the longest query within the server's 64 KiB request line, which
        # 7,400 characters of any Unicode, percent-encoded, would not be (uvicorn answers that itself, in text/plain).
        Query(max_length=200 * 37, pattern=r"^[0-9A-Za-z_, -]*$", description="comma-separated job ids (at most 200)"),
    ],
    names: Annotated[
        str, Query(max_length=1000, description="comma-separated metric names, e.g. lm_loss,loss")
    ] = "lm_loss",
    devices: Annotated[bool, Query(description="also each device's newest telemetry (the hosts page)")] = False,
) -> JobLatestList:
    """Per job: its last step, the last job-wide value of each named metric and its last progress event (the job
    list's progress and latest-loss columns). Jobs you cannot see are left out, as unknown ones are."""
    wanted_ids = [i.strip() for i in ids.split(",") if i.strip()]
    wanted = [n.strip() for n in names.split(",") if n.strip()][:20]
    if len(wanted_ids) > 200:
        raise ApiError(400, "bad_request", "ids: at most 200 job ids", "ids")
    out = []
    for job_id in dict.fromkeys(wanted_ids):
        try:
            get_visible_job(session, job_id, principal)
        except ApiError:
            continue
        values = records.latest_values(session, job_id, wanted)
        out.append(
            JobLatest(
                job_id=job_id,
                step=records.last_step(session, job_id),
                values={k: v for k, (_, v) in values.items()},
                value_steps={k: s for k, (s, _) in values.items()},
                progress=records.last_event_data(session, job_id, "progress"),
                devices=records.latest_device_values(session, job_id) if devices else None,
            )
        )
    return JobLatestList(data=out)
