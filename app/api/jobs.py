"""Job resources: submit, list, get, cancel."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app import openai_method
from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.input_guard import check_metadata
from app.schemas import JobDeleted, JobPublic, ListPage, PipelineStepPublic
from core import (
    admission,
    checkpoints,
    deployments,
    effective_spec,
    job_delete,
    paths,
    pipelines,
    records,
    team_limits,
    tracking,
)
from core import jobs as service
from core.errors import ApiError
from core.pubsub import notify
from core.scheduler import check_fits, check_memory_fits
from core.settings import Settings
from core.states import JobState
from core.stored_spec import stored_spec
from engine.contract.spec import EvalSpec, JobBase, PipelineSpec, Resources, parse_spec

# What core.jobs takes ("" is the default), documented so that a client (and schemathesis) can tell beforehand; the
# server's own 422 names the choices.
SORT_PATTERN = rf"^$|^ *-?({'|'.join(service.SORTS)}) *$"
_STATE = f"({'|'.join(s.value for s in JobState)})"
STATE_PATTERN = rf"^$|^ *{_STATE}( *, *{_STATE})* *$"
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS: dict[int | str, dict[str, Any]] = {401: {"description": "No or bad token"}, 404: {"description": "No such job"}}
SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
    }
}


def requested_resources(raw: Any) -> Resources | None:
    """The ``resources`` of a (non-pipeline) body, when they are valid on their own; else None (the schema says why)."""
    if not isinstance(raw, dict) or raw.get("kind") == "pipeline":
        return None
    try:
        return Resources.model_validate(raw.get("resources") or {}, strict=True)
    except ValidationError:
        return None


def parse_request_spec(raw: Any, areas: paths.Areas) -> JobBase:
    """The spec of a request body, every path resolved inside the caller's areas (``core.paths``)."""
    if not isinstance(raw, dict):
        raise ApiError(422, "validation_error", "the body must be a JSON object (a job spec)", None)
    raw = openai_method.expand(raw)  # OpenAI's fine-tuning ``method`` onto stage / dpo_beta / global_batch_size
    admission.check_fields(raw)  # unknown kind or field: "did you mean", before the schema's bare error
    return parse_spec(raw, **areas.context(), strict=True)  # a typed API: "20" is not a number (issue 27)


@router.post(
    "",
    status_code=201,
    response_model=JobPublic,
    openapi_extra=SPEC_BODY,
    responses={
        **ERRORS,
        409: {"description": "Idempotency-Key reused with another body"},
        413: {"description": "Body too large"},
        422: {"description": "Invalid spec, or resources no registered host could ever provide"},
        429: {"description": "The team has team_max_active_jobs unfinished jobs (see Retry-After)"},
    },
)
async def create_job(
    request: Request,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobPublic:
    """Submit a job. With an Idempotency-Key, a replay of the same body returns the same job."""
    try:
        raw = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {err}", None) from err
    raw = await run_in_threadpool(checkpoints.expand_references, session, principal, raw)  # {"job", "iteration"}
    try:
        areas = paths.ensure_team_areas(settings, principal.team)
    except ValueError as err:  # a team name that cannot name a directory (tokens made before names were checked)
        raise ApiError(403, "forbidden", f"{err}; ask an admin for a token of a valid team", None) from None
    resources = requested_resources(raw)
    if resources is not None:  # the real blocker first: 64 ranks on a 1-slot host is not a global_batch_size error
        await run_in_threadpool(check_fits, session, settings, principal.team, resources)
    spec = parse_request_spec(raw, areas)
    check_metadata(raw, settings)
    job, created = await run_in_threadpool(_submit, session, settings, principal.team, spec, raw, idempotency_key)
    if created:
        request.app.state.dispatcher.wake()  # scheduling runs in its own loop (core.dispatch), not in this request
    else:
        response.headers["Idempotent-Replayed"] = "true"
    return job


def _submit(
    session: Session, settings: Settings, team: str, spec: JobBase, raw: Any, key: str | None
) -> tuple[JobPublic, bool]:
    team_limits.check_priority(settings, team, raw)  # 422 above the team's ceiling
    team_limits.check_active_jobs(session, settings, team, key)  # 429 past team_max_active_jobs
    if isinstance(spec, EvalSpec):  # a deployment it names: the team's, ready; its tokenizer fills the spec's
        deployments.attach_eval(session, team, spec)
    tracking.prepare(session, settings, team, spec)  # report_to: the team's defaults, the server's address, the token
    admission.check_admissible(spec, settings, team)  # what the engine would refuse before its first step (reads files)
    admission.apply_team_defaults(spec, settings, team)
    if isinstance(spec, PipelineSpec):  # its steps run as child jobs, driven by core.pipelines
        job, created = pipelines.submit(session, settings, team, spec, raw, key)
        return _public(session, job), created
    # 422 when a rank would not fit any registered device (engine.contract.plan; traced under admission_trace_s)
    check_memory_fits(session, spec, settings)
    job, created = service.create_job(session, settings=settings, team=team, spec=spec, raw=raw, idempotency_key=key)
    return JobPublic.from_row(job), created


@router.get("", response_model=ListPage[JobPublic], responses=ERRORS)
def list_jobs(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    state: Annotated[
        str | None,
        Query(description="one state, or several comma-separated", json_schema_extra={"pattern": STATE_PATTERN}),
    ] = None,
    kind: Annotated[Literal["preprocess", "convert", "train", "eval", "serve", "pipeline"] | None, Query()] = None,
    name: str | None = None,
    parent_id: str | None = None,
    after: Annotated[str | None, Query(description="last_id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
    sort: Annotated[
        str | None,
        Query(
            max_length=20,
            json_schema_extra={"pattern": SORT_PATTERN},  # documented; parse_sort refuses the rest, naming the keys
            description=(
                f"one of {', '.join(service.SORTS)}; prefix - for descending (default {service.DEFAULT_SORT}); "
                "blanks last either way; paging with after= follows the same order"
            ),
        ),
    ] = None,
) -> ListPage[JobPublic]:
    """List your team's jobs, newest first (or by ``sort``). Filter metadata with metadata[key]=value."""
    metadata = {
        k[len("metadata[") : -1]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata[") and k.endswith("]")
    }
    rows, has_more = service.list_jobs(
        session,
        principal=principal,
        state=state,
        kind=kind,
        name=name,
        metadata=metadata,
        parent_id=parent_id,
        after=after,
        limit=limit,
        sort=sort,
    )
    return ListPage[JobPublic].of(with_progress(session, [JobPublic.from_row(j) for j in rows]), has_more)


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
def get_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> JobPublic:
    """One job, with its state, error and result; a pipeline also lists its steps and their jobs."""
    return _public(session, service.get_visible_job(session, job_id, principal))


class EffectiveField(BaseModel):
    field: str
    value: Any = Field(description="null when unset, or when the checkpoint that decides it was not read yet")
    source: effective_spec.Source = Field(
        description="set (by the submitted spec), checkpoint (read from the one it loads), checkpoint-unread, engine "
        "(what this engine builds: Qwen3), default (the spec model's), unset"
    )
    description: str


class EffectiveSpec(BaseModel):
    object: Literal["list"] = "list"
    data: list[EffectiveField]


@router.get("/{job_id}/effective-spec", response_model=EffectiveSpec, responses=ERRORS)
def get_effective_spec(job_id: str, session: SessionDep, principal: PrincipalDep) -> EffectiveSpec:
    """Every field of the job's kind with the value it runs with and where that comes from (the Spec tab)."""
    job = service.get_visible_job(session, job_id, principal)
    return EffectiveSpec(data=[EffectiveField(**row) for row in effective_spec.effective_fields(job)])


def with_progress(session: Session, jobs: list[JobPublic]) -> list[JobPublic]:
    """``trained_tokens`` and ``estimated_finish`` of the train jobs among ``jobs`` (one query for all)."""
    progress = records.train_progress(session, [j.id for j in jobs if j.kind == "train"])
    for job in jobs:
        if job.id not in progress:
            continue
        tokens, step, last = progress[job.id]
        job.trained_tokens, job.iteration = tokens, step
        iters = stored_spec(job.spec).train_iters
        if job.finished_at is not None:
            job.estimated_finish = job.finished_at
        elif job.started_at is not None and isinstance(iters, int) and step > 0:
            job.estimated_finish = estimate_finish(_utc(job.started_at), _utc(last), step, iters)
    return jobs


def estimate_finish(start: datetime, last: datetime, step: int, iters: int, now: datetime | None = None) -> datetime:
    """When a running train job ends at its pace so far (``step`` iterations by ``last``). Never in the past: after a
    stall or a restart the remaining iterations are counted from now."""
    per_step = max(last - start, timedelta(0)) / step
    now = now or datetime.now(timezone.utc)
    return max(last, now) + per_step * max(iters - step, 0)


def _utc(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def _public(session: Session, job: Any) -> JobPublic:
    public = with_progress(session, [JobPublic.from_row(job)])[0]
    if job.kind == "pipeline":
        steps = pipelines.step_views(session, job)
        public.steps = [PipelineStepPublic(**step) for step in steps]
        public.pending_reason = pipelines.waiting_reason(steps) if not JobState(job.state).is_terminal() else None
    return public


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=JobPublic,
    responses={**ERRORS, 409: {"description": "The job already finished"}},
)
def cancel_job(job_id: str, session: SessionDep, principal: PrincipalDep, settings: SettingsDep) -> JobPublic:
    """Cancel a job: at once if it has not started, else the worker stops its processes (SIGTERM, then SIGKILL)."""
    job = service.get_visible_job(session, job_id, principal)
    job = pipelines.cancel(session, settings, job) if job.kind == "pipeline" else service.request_cancel(session, job)
    notify(settings.redis_url, job_id, state=1)
    return _public(session, job)


@router.delete(
    "/{job_id}",
    response_model=JobDeleted,
    responses={**ERRORS, 409: {"description": "The job (or a step of the pipeline) has not ended"}},
)
def delete_job(
    job_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    outputs: Annotated[
        bool,
        Query(
            description="also remove the files and directories its artifacts list (inside the "
            "data roots); default: only its records and run directory"
        ),
    ] = False,
) -> JobDeleted:
    """Delete a finished job: its records, events, metrics and logs, its run directory (a pipeline: its steps too)."""
    job = service.get_visible_job(session, job_id, principal)
    return JobDeleted(**job_delete.delete_job(session, settings, job, outputs=outputs))
