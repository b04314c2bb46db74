"""Deployments: the ``serve`` jobs a team can send requests to, and where their engines listen.

A ``serve`` job's engine reports ``ready`` with its endpoint's URL (``engine.serve.job``); the worker ingests the
event with the attempt it belongs to. A deployment is *ready* when its job is running and its current attempt has
reported ``ready``: a restarted attempt (host lost, engine crashed) is not ready again until its own engine says so,
so a request never reaches the URL of a dead attempt. Names: a request's ``model`` matches a job's
``served_model_name``, else its name, else its id, or one of its ``lora_adapters`` or of the adapters loaded into
its running engine since (``core.live_adapters``; then the request goes to that job's engine, which applies the
adapter, as vLLM's multi-LoRA serving does); only the caller's team's jobs are
searched (another team's deployment reads as missing, never as forbidden). ``GET /v1/models`` lists ready ones only,
less those whose engine was just found not answering (the API proxy's short unhealthy mark, ``app.engine_proxy``),
so a deployment whose engine died drops out at its first failed request, before its job is seen to end.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.auth import Principal
from core.db import session_scope
from core.errors import ApiError
from core.live_adapters import loaded_adapters
from core.models import Event, Job
from core.settings import Settings
from core.states import TERMINAL, JobState
from core.stored_spec import stored_spec
from engine.contract.spec import EvalSpec


@dataclasses.dataclass(frozen=True)
class Deployment:
    job_id: str
    team: str
    name: str
    state: str
    url: str | None  # None until the current attempt's engine reports ready
    created: int  # unix seconds
    root: str = ""  # the base model's path (an OpenAI model object's ``root``, as vLLM gives it)
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)  # LoRA adapter name -> its checkpoint
    adapter: str | None = None  # the adapter a request's ``model`` chose (None: the base)

    @property
    def ready(self) -> bool:
        return self.url is not None


def served_name(job: Job) -> str:
    """The name clients pass as ``model``: as ``engine.serve.job.served_name`` decides it (the run dir is the id)."""
    return stored_spec(job.spec).served_model_name or job.name or job.id


def _ready_url(session: Session, job: Job) -> str | None:
    if job.state != JobState.running.value:
        return None
    event = session.scalars(
        select(Event)
        .where(Event.job_id == job.id, Event.type == "ready", Event.attempt == job.attempt_count)
        .order_by(Event.id.desc())
        .limit(1)
    ).first()
    url = (event.data or {}).get("url") if event is not None else None
    return url if isinstance(url, str) else None


def _deployment(session: Session, job: Job) -> Deployment:
    created = int(job.created_at.timestamp()) if job.created_at else 0
    spec = stored_spec(job.spec)
    url = _ready_url(session, job)
    adapters = spec.lora_adapters
    if url is not None:  # and those loaded into its current attempt since (core.live_adapters)
        adapters = {**adapters, **loaded_adapters(session, job)}
    return Deployment(job.id, job.team, served_name(job), job.state, url, created, str(spec.load), adapters)


def _live_serve_jobs(session: Session, principal: Principal) -> list[Job]:
    query = select(Job).where(Job.kind == "serve", Job.state.not_in([s.value for s in TERMINAL]))
    if not principal.admin:
        query = query.where(Job.team == principal.team)
    return list(session.scalars(query.order_by(Job.created_at.desc())))


def list_deployments(session: Session, principal: Principal) -> list[Deployment]:
    """The caller's team's deployments that are not over (queued, starting, running), newest first."""
    return [_deployment(session, job) for job in _live_serve_jobs(session, principal)]


def ready_urls(session: Session) -> set[str]:
    """The engine URLs of every team's ready deployments (the API's proxy closes its clients of any other URL)."""
    running = session.scalars(select(Job).where(Job.kind == "serve", Job.state == JobState.running.value))
    return {url for job in list(running) if (url := _ready_url(session, job)) is not None}


def find_deployment(session: Session, principal: Principal, model: str) -> Deployment | None:
    """The deployment ``model`` names among the caller's team's live ones (a ready one first), or None; a name of
    one of its adapters gives the deployment with ``adapter`` set."""
    found = []
    for job in _live_serve_jobs(session, principal):
        if model in (job.id, served_name(job)):
            found.append(_deployment(session, job))
        elif model in (dep := _deployment(session, job)).adapters:
            found.append(dataclasses.replace(dep, adapter=model))
    return next((d for d in found if d.ready), found[0] if found else None)


def _team(team: str) -> Principal:
    return Principal(team=team, admin=False, token_id=0)


def attach_eval(session: Session, team: str, spec: EvalSpec) -> None:
    """Submission of an eval naming a ``deployment``: it must be one of the team's and ready (else 422 naming
    ``deployment``); its tokenizer and ``prompt_type`` fill the spec's unset ones, so prompts are rendered as the
    deployment renders its own."""
    if spec.deployment is None:
        return
    found = find_deployment(session, _team(team), spec.deployment)
    if found is None:
        message = f"deployment: no deployment {spec.deployment!r} in team {team} (GET /v1/models lists them)"
        raise ApiError(422, "validation_error", message, "deployment")
    if not found.ready:
        message = f"deployment: {spec.deployment!r} is {found.state}, not ready; submit once GET /v1/models lists it"
        raise ApiError(422, "validation_error", message, "deployment")
    job = session.get(Job, found.job_id)
    serve: dict[str, Any] = (job.spec if job is not None else None) or {}
    if spec.tokenizer_name_or_path is None:
        spec.tokenizer_name_or_path = serve.get("tokenizer_name_or_path") or serve.get("load")
    if spec.prompt_type is None:
        spec.prompt_type = serve.get("prompt_type")


def with_deployment_url(settings: Settings, team: str, spec: dict[str, Any]) -> dict[str, Any]:
    """At launch: an eval naming a ``deployment`` gets the URL of its current ready attempt (``deployment_url``) and
    the name that deployment's engine serves the chosen model under. RuntimeError (a retryable launch failure) when
    it is not ready now (restarting, or gone)."""
    name = stored_spec(spec).deployment
    if stored_spec(spec).kind != "eval" or not name:
        return spec
    with session_scope(settings.database_url) as session:
        found = find_deployment(session, _team(team), str(name))
    if found is None or found.url is None:
        raise RuntimeError(f"deployment {name!r} is not ready ({found.state if found else 'gone'}); retrying")
    return {**spec, "deployment_url": found.url, "deployment": found.adapter or found.name}
