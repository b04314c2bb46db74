"""The pipeline driver: runs a ``pipeline`` job's steps one after another as child jobs (``parent_id``).

The pipeline row itself never runs anything (the scheduler skips ``kind = pipeline``). ``advance`` looks at the
children in the database and does the one next thing: create and dispatch the next step's child (its
``${steps.<name>.outputs.<key>}`` references replaced from the finished children's ``result.outputs``), move the
pipeline's own state to follow its children, or finish it. It is idempotent and safe to run concurrently: a child's
Idempotency-Key is ``pipeline:<pipeline id>:<step>``, so two drivers can never create a step twice. Workers call
``advance_parent`` when a job ends; the API's reconciler calls ``advance_all`` as a safety net (lost hosts, start
deadlines, cancels settled elsewhere). A submission (``submit``, inside the request) creates the first step's child
but leaves its dispatch to the API's ``Dispatcher`` loop, as for a single job: no scheduling pass in the request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from core import jobs as service
from core import tracking
from core.admission import apply_team_defaults
from core.db import each_row, session_scope
from core.dispatch import dispatch
from core.errors import ApiError
from core.models import Job
from core.paths import team_areas
from core.pubsub import notify
from core.scheduler import check_fits
from core.settings import Settings
from core.states import ACTIVE, TERMINAL, WAITING, JobState
from core.stored_spec import stored_spec
from engine.contract.spec import (
    PipelineSpec,
    PipelineStep,
    find_references,
    first_error,
    parse_spec,
    substitute_references,
)

log = logging.getLogger(__name__)
STEP_LABEL = (
    "pipeline_step"  # metadata label every child carries: GET /v1/jobs?parent_id=P&metadata[pipeline_step]=train
)
FAILED = (JobState.failed.value, JobState.cancelled.value)


@dataclass
class StepView:
    """One step as GET /v1/jobs/{id} shows it: ``state`` is the child's state, or pending / skipped (no child)."""

    name: str
    kind: str
    state: str
    job_id: str | None = None
    reason: str | None = None

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "state": self.state, "job_id": self.job_id, "reason": self.reason}


@dataclass
class Decision:
    """What the driver does next: wait for a child, create step ``index``, or finish the pipeline."""

    action: Literal["wait", "create", "finish"]
    index: int = -1
    state: JobState | None = None
    error: str | None = None
    views: list[StepView] = field(default_factory=list)
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)


class StepError(Exception):
    """A step's spec cannot be made runnable (a missing output, or invalid once resolved): the pipeline fails."""


def _outputs(child: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in ((child.result or {}).get("outputs") or {}).items()}


def decide(spec: PipelineSpec, children: Mapping[str, Any], stopping: bool = False) -> Decision:
    """The pure part of the driver: from the children's states, the step views and the next action.

    ``children`` maps step names to their jobs (rows, or anything with the same state/result/error attributes)."""
    done: dict[str, dict[str, str]] = {}
    failed: list[str] = []
    skipped: list[str] = []
    decision: Decision | None = None
    views: list[StepView] = []
    for index, step in enumerate(spec.steps):
        kind, child = stored_spec(step.spec).kind, children.get(step.name)
        if decision is not None:  # after the step the pipeline is at: not run yet, or never (fail fast, cancel)
            later = "skipped" if decision.action == "finish" else "pending"
            views.append(StepView(step.name, kind, later, reason=decision.error if later == "skipped" else None))
            continue
        if child is None:
            missing = sorted({ref for _, ref, _ in find_references(step.spec) if ref not in done})
            if missing:
                skipped.append(step.name)
                views.append(
                    StepView(
                        step.name,
                        kind,
                        "skipped",
                        reason=f"needs the outputs of {', '.join(missing)}, which did not succeed",
                    )
                )
                continue
            if stopping:
                decision = Decision("finish", state=JobState.cancelled, error="the pipeline was cancelled")
                views.append(StepView(step.name, kind, "skipped", reason=decision.error))
                continue
            decision = Decision("create", index=index)
            views.append(StepView(step.name, kind, "pending"))
            continue
        views.append(StepView(step.name, kind, child.state, child.id, reason=child.pending_reason))
        if child.state == JobState.succeeded.value:
            done[step.name] = _outputs(child)
        elif child.state in FAILED:
            failed.append(step.name)
            if spec.on_failure == "fail_fast" or stopping:
                state = JobState.cancelled if stopping else JobState.failed
                decision = Decision(
                    "finish",
                    state=state,
                    error=f"step {step.name} {child.state}: {child.error_message or child.error_code or ''}".strip(),
                )
        else:
            decision = Decision("wait")
    if decision is None:
        if stopping:
            decision = Decision("finish", state=JobState.cancelled, error="the pipeline was cancelled")
        elif failed or skipped:
            parts = [f"failed: {', '.join(failed)}"] + ([f"skipped: {', '.join(skipped)}"] if skipped else [])
            decision = Decision("finish", state=JobState.failed, error="steps " + "; ".join(parts))
        else:
            decision = Decision("finish", state=JobState.succeeded)
    decision.views, decision.outputs = views, done
    return decision


def children_by_step(session: Session, pipeline_id: str) -> dict[str, Job]:
    rows = session.scalars(select(Job).where(Job.parent_id == pipeline_id).order_by(Job.created_at))
    return {str((c.meta or {}).get(STEP_LABEL)): c for c in rows}


def step_views(session: Session, job: Job) -> list[dict[str, Any]]:
    """The steps of a pipeline row, for GET /v1/jobs/{id}."""
    spec = PipelineSpec.model_validate(job.spec)
    stopping = job.state in (JobState.cancelling.value, JobState.cancelled.value)
    views = decide(spec, children_by_step(session, job.id), stopping).views
    if JobState(job.state) in TERMINAL:  # a pipeline that ended (a step it could not make runnable) runs no more
        ended = f"the pipeline {job.state}" + (f": {job.error_message}" if job.error_message else "")
        for view in views:
            if view.state == "pending":
                view.state, view.reason = "skipped", ended
    return [v.public() for v in views]


def waiting_reason(steps: list[dict[str, Any]]) -> str | None:
    """Why a pipeline waits: its waiting step's pending reason (shown as the pipeline's ``pending_reason``)."""
    for step in steps:
        if step["state"] in (JobState.queued.value, JobState.retrying.value) and step["reason"]:
            return f"step {step['name']}: {step['reason']}"
    return None


def child_name(pipeline: str | None, step: str) -> str:
    """``<pipeline name>/<step>`` (the step alone for an unnamed pipeline), within the 200 characters of a name."""
    return f"{pipeline[: 199 - len(step)]}/{step}" if pipeline else step


def child_body(parent: Any, spec: PipelineSpec, index: int, done: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Step ``index``'s spec with its references resolved, the parent's labels and priority inherited."""
    step: PipelineStep = spec.steps[index]

    def resolve(ref: str, key: str) -> str:
        if key not in done[ref]:
            raise StepError(
                f"steps.{index}.spec: step {ref} has no output {key!r} "
                f"(its outputs: {', '.join(sorted(done[ref])) or 'none'})"
            )
        return done[ref][key]

    body = substitute_references(step.spec, resolve)
    body["metadata"] = {**(parent.meta or {}), **(body.get("metadata") or {}), STEP_LABEL: step.name}
    body.setdefault("name", child_name(parent.name, step.name))
    body.setdefault("priority", parent.priority)
    return body


def _create_child(
    settings: Settings, session: Session, parent: Job, spec: PipelineSpec, decision: Decision, dispatch_now: bool
) -> Job:
    body = child_body(parent, spec, decision.index, decision.outputs)
    try:
        child_spec = parse_spec(body, **team_areas(settings, parent.team).context())
    except ValidationError as err:
        raise StepError(first_error(err, f"steps.{decision.index}.spec")) from None
    apply_team_defaults(child_spec, settings, parent.team)  # each step is bounded as the same job alone would be
    tracking.fill(session, parent.team, child_spec)  # the team's report_to default, as the same job alone would get
    key = f"pipeline:{parent.id}:{spec.steps[decision.index].name}"
    child, created = service.create_job(
        session,
        settings=settings,
        team=parent.team,
        spec=child_spec,
        raw=body,
        idempotency_key=key,
        parent_id=parent.id,
    )
    if created:
        service.add_event(
            session,
            parent.id,
            "step",
            f"step {spec.steps[decision.index].name} submitted as job {child.id}",
            data={"step": spec.steps[decision.index].name, "job_id": child.id},
        )
        session.commit()
        if dispatch_now:  # else the caller wakes a Dispatcher, whose dispatch_new sends it (never dispatched yet)
            dispatch(settings, child.id, child.queue)
    return child


def _follow_children(session: Session, parent: Job, children: dict[str, Job]) -> None:
    """queued -> starting -> running once a child has started (a pipeline runs as soon as one of its steps does)."""
    started = any(c.state not in (JobState.queued.value,) for c in children.values())
    if parent.state == JobState.queued.value and started:
        service.transition(
            session, parent.id, JobState.starting, only_from=[JobState.queued], message="first step started"
        )
    if parent.state in (JobState.queued.value, JobState.starting.value) and started:
        service.transition(session, parent.id, JobState.running, only_from=[JobState.starting], message="running steps")


def _finish(settings: Settings, session: Session, parent: Job, decision: Decision) -> None:
    state = decision.state or JobState.failed
    if state is JobState.succeeded:  # succeeded is entered from starting/running only
        for step_state, source in ((JobState.starting, JobState.queued), (JobState.running, JobState.starting)):
            service.transition(session, parent.id, step_state, only_from=[source], message="steps ran")
    outputs = {f"{name}.{key}": value for name, out in decision.outputs.items() for key, value in out.items()}
    result = {
        "kind": "pipeline",
        "outputs": outputs,
        "summary": {"steps": [v.public() for v in decision.views], "succeeded": len(decision.outputs)},
    }
    values: dict[str, Any] = {"result": result}
    if state is JobState.failed:
        values.update(error_code="step_failed", error_message=decision.error)
    only_from = [JobState.cancelling] if state is JobState.cancelled and parent.state == "cancelling" else None
    service.transition(
        session,
        parent.id,
        state,
        only_from=only_from,
        message=decision.error or f"all {len(decision.views)} steps succeeded",
        **values,
    )


def advance(settings: Settings, pipeline_id: str, dispatch_now: bool = True) -> str:
    """Do the next thing for one pipeline; returns its state afterwards. ``dispatch_now=False`` creates a step's
    child without a scheduling pass (the request path: the API's Dispatcher, woken by it, dispatches the child)."""
    with session_scope(settings.database_url) as session:
        parent = session.get(Job, pipeline_id)
        if parent is None or parent.kind != "pipeline":
            return "missing"
        if JobState(parent.state) in TERMINAL:
            return parent.state
        spec = PipelineSpec.model_validate(parent.spec)
        stopping = parent.state == JobState.cancelling.value
        children = children_by_step(session, parent.id)
        decision = decide(spec, children, stopping)
        try:
            if decision.action == "create":
                child = _create_child(settings, session, parent, spec, decision, dispatch_now)
                session.expire_all()
                if (fresh := session.get(Job, pipeline_id)) is not None and fresh.state in ("cancelling", "cancelled"):
                    service.request_cancel(session, child)  # a cancel raced with this step's creation
            elif decision.action == "finish":
                _finish(settings, session, parent, decision)
            _follow_children(session, parent, children)
        except StepError as err:
            service.transition(
                session, parent.id, JobState.failed, error_code="step_invalid", error_message=str(err), message=str(err)
            )
        session.expire_all()
        state = session.scalar(select(Job.state).where(Job.id == pipeline_id)) or "missing"
    notify(settings.redis_url, pipeline_id, state=1)
    return state


def advance_parent(settings: Settings, job_id: str) -> None:
    """Called when ``job_id`` may have ended: move its pipeline on, if it belongs to one."""
    try:
        with session_scope(settings.database_url) as session:
            parent_id = session.scalar(select(Job.parent_id).where(Job.id == job_id))
        if parent_id:
            advance(settings, parent_id)
    except Exception:  # noqa: BLE001 - the reconciler advances it later; the worker must go on
        log.exception("advancing the pipeline of job %s failed (the reconciler retries)", job_id)


def advance_all(settings: Settings) -> int:
    """One pass over every unfinished pipeline (the reconciler's safety net). Returns how many it looked at."""
    unfinished = select(Job.id).where(Job.kind == "pipeline", Job.state.notin_([s.value for s in TERMINAL]))
    return each_row(settings.database_url, unfinished, lambda job_id: advance(settings, job_id), "advancing pipeline")


def check_steps_fit(session: Session, settings: Settings, team: str, spec: PipelineSpec) -> None:
    """422 at submission if a step asks for resources no registered host set could ever give."""
    for index, step in enumerate(spec.steps):
        try:
            check_fits(session, settings, team, stored_spec(step.spec).resources)
        except ApiError as err:
            field_name = f"steps.{index}.spec.{err.field}" if err.field else f"steps.{index}.spec.resources"
            raise ApiError(err.status, err.code, f"steps.{index}.spec.{err.message}", field_name) from None


def submit(
    session: Session, settings: Settings, team: str, spec: PipelineSpec, raw: Any, key: str | None
) -> tuple[Job, bool]:
    """Create the pipeline row and its first step, committed but not scheduled: the caller wakes the Dispatcher, as
    for a single job (an Idempotency-Key replay returns the first pipeline)."""
    check_steps_fit(session, settings, team, spec)
    job, created = service.create_job(session, settings=settings, team=team, spec=spec, raw=raw, idempotency_key=key)
    if created:
        advance(settings, job.id, dispatch_now=False)
        session.expire_all()
        job = session.get(Job, job.id) or job
    return job, created


def cancel(session: Session, settings: Settings, job: Job) -> Job:
    """Cancel a pipeline: the step that runs is cancelled (SIGTERM, then SIGKILL), the later ones never start."""
    parent = service.request_cancel(session, job)  # 409 if already finished; waiting -> cancelled, else cancelling
    for child in children_by_step(session, job.id).values():
        if JobState(child.state) in WAITING or JobState(child.state) in ACTIVE:
            service.request_cancel(session, child)
            notify(settings.redis_url, child.id, state=1)
    advance(settings, job.id)
    session.expire_all()
    return session.get(Job, job.id) or parent
