"""LoRA adapters loaded into and unloaded from a running deployment, in vLLM's shape: ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (200 with vLLM's text), plus
``model`` naming the deployment when the team has more than one.

Loading is checked as a submission's ``lora_adapters`` entry is: ``lora_path`` (a path, or a ``{"job", "iteration"}``
reference to the team's LoRA checkpoint) resolved inside the caller's team's areas, the checkpoint's tensors read
and fitted to the deployment's base (``core.admission``), the name unique among the team's live deployments' names
and adapters (409, ``core.jobs.check_served_names``, then its ``served_names`` row). The engine then reads it again
under the job's own areas from a private copy made without following links (``engine.serve.server``), and the load
is recorded (``core.live_adapters``): ``GET /v1/models`` lists it under its deployment at once, requests may name
it, and after an unload it is gone from both. Another team's deployments and adapters read as missing (404).
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.api import jobs as jobs_api
from app.api.deps import SettingsDep
from app.api.openai_compat import Credentials, _body, _caller, _error, _serving, _with_session
from app.openai_format import OpenAIError
from core import admission, checkpoints, live_adapters, paths
from core.auth import Principal
from core.deployments import Deployment, find_deployment, list_deployments
from core.errors import ApiError
from core.jobs import check_served_names
from core.models import Job
from core.settings import Settings
from core.stored_spec import stored_spec
from engine.contract.spec import ServeSpec

router = APIRouter(prefix="/v1", tags=["openai"])
LOAD_FIELDS, UNLOAD_FIELDS = {"lora_name", "lora_path", "model"}, {"lora_name", "model"}
ENGINE_TIMEOUT_S = 300.0  # reading and copying a checkpoint on the worker host


@router.post("/load_lora_adapter", response_model=None)
async def load_lora_adapter(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """vLLM's load: LoRA checkpoint ``lora_path`` served as ``lora_name`` by the deployment (``model``)."""
    try:
        principal, body, name = await _adapter_request(request, settings, credentials, LOAD_FIELDS)
        if not isinstance(body.get("lora_path"), (str, dict)) or not body["lora_path"]:
            raise OpenAIError(400, "lora_path: a path or a {job, iteration} reference is required", "lora_path")
        dep, path = await anyio.to_thread.run_sync(
            _with_session, settings, lambda s: _prepare_load(s, settings, principal, body)
        )
        try:
            await _engine(request, dep, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except OpenAIError:
            await anyio.to_thread.run_sync(
                _with_session, settings, lambda s: live_adapters.release_name(s, principal.team, name, dep.job_id)
            )
            raise
        await anyio.to_thread.run_sync(_with_session, settings, lambda s: _record(s, dep, name, path, True))
    except OpenAIError as err:
        return _error(err)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter", response_model=None)
async def unload_lora_adapter(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """vLLM's unload: ``lora_name`` is no longer served; its name is the team's to give again."""
    try:
        principal, body, name = await _adapter_request(request, settings, credentials, UNLOAD_FIELDS)
        dep, loaded = await anyio.to_thread.run_sync(
            _with_session, settings, lambda s: _holder(s, principal, name, body.get("model"))
        )
        if loaded is not None and dep.ready:
            try:
                await _engine(request, dep, "/v1/unload_lora_adapter", {"lora_name": name})
            except OpenAIError as err:
                if err.status != 404:  # 404: the engine restarted without it; the name is released all the same
                    raise

        def release(session: Session) -> None:
            live_adapters.release_name(session, principal.team, name, dep.job_id)
            if loaded is not None:
                _record(session, dep, name, loaded, False)

        await anyio.to_thread.run_sync(_with_session, settings, release)
    except OpenAIError as err:
        return _error(err)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _adapter_request(
    request: Request, settings: Settings, credentials: HTTPAuthorizationCredentials | None, allowed: set[str]
) -> tuple[Principal, dict[str, Any], str]:
    """The caller, the body (``allowed`` fields only) and the adapter's name of a load or unload request."""
    principal = await _caller(request, settings, credentials)
    body = _fields(await _body(request), allowed)
    return principal, body, _name(body)


def _fields(body: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(400, f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})", unknown[0])
    if "model" in body and not isinstance(body["model"], str):
        raise OpenAIError(400, "model: must be a string (a deployment's name, see GET /v1/models)", "model")
    return body


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name.strip() or len(name) > 255 or name != name.strip():
        raise OpenAIError(
            400, "lora_name: a name of 1 to 255 characters, no surrounding blanks, is required", "lora_name"
        )
    return name


def _deployment(session: Session, principal: Principal, model: str | None) -> Deployment:
    """The base deployment ``model`` names, else the team's only ready one."""
    if model is None:
        ready = [d for d in list_deployments(session, principal) if d.ready]
        if len(ready) != 1:
            message = f"model: your team has {len(ready)} ready deployments; name the one to load into"
            raise OpenAIError(400, message, "model")
        return ready[0]
    dep = find_deployment(session, principal, model)
    if dep is None:
        raise OpenAIError(404, f"model: no deployment {model!r} (see GET /v1/models)", "model", "model_not_found")
    if dep.adapter is not None:
        raise OpenAIError(400, f"model: {model!r} is an adapter of {dep.name!r}; name the deployment", "model")
    if not dep.ready:
        raise OpenAIError(503, f"deployment {model!r} is {dep.state}, not ready yet", "model", "model_not_ready")
    return dep


def _prepare_load(
    session: Session, settings: Settings, principal: Principal, body: dict[str, Any]
) -> tuple[Deployment, str]:
    """The deployment and the adapter's resolved path, checked as at submission, its name held; or an OpenAIError."""
    name = body["lora_name"]
    dep = _deployment(session, principal, body.get("model"))
    if name in dep.adapters or name == dep.name:
        message = f"lora_name: {name!r} is already served by deployment {dep.job_id}; unload it first"
        raise OpenAIError(409, message, "lora_name", "conflict")
    job = session.get(Job, dep.job_id)
    assert job is not None  # found just now; a job is deleted only once it ended
    raw = {k: v for k, v in (job.spec or {}).items() if k != "deployment_url"}
    raw["lora_adapters"] = {name: body["lora_path"]}
    try:
        raw = checkpoints.expand_references(session, principal, raw)  # a {"job", "iteration"} reference
        spec = jobs_api.parse_request_spec(raw, paths.ensure_team_areas(settings, principal.team))
        assert isinstance(spec, ServeSpec)  # the deployment's own spec
        admission.check_admissible(spec, settings, principal.team)  # the checkpoint's tensors fit the base
        probe = spec.model_copy(update={"served_model_name": None, "name": None})  # the adapter's name alone
        check_served_names(session, principal.team, probe)
        live_adapters.reserve_name(session, principal.team, name, dep.job_id)
    except ApiError as err:
        raise _openai(err.status, err.message, err.field, name) from err
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]).removeprefix("serve.")  # the kind's union tag
        raise _openai(400, f"{where}: {first['msg']}", where, name) from err
    return dep, str(spec.lora_adapters[name])


def _openai(status: int, message: str, field: str | None, name: str) -> OpenAIError:
    """A submission check's refusal in OpenAI's shape, the spec's field named as this route's."""
    prefix = f"lora_adapters.{name}"
    if field is not None and field.startswith(prefix):
        field, message = "lora_path", message.replace(prefix, "lora_path", 1)
    elif field == "lora_adapters":
        field = "lora_path"
    code = "conflict" if status == 409 else None
    return OpenAIError(409 if status == 409 else 400, message, field, code)


def _holder(session: Session, principal: Principal, name: str, model: str | None) -> tuple[Deployment, str | None]:
    """The deployment ``name`` was loaded into (``model``'s when given) and its path if its engine holds it now
    (None: loaded into an earlier attempt, only the name is held); 404 when no such adapter is the team's."""
    holder = live_adapters.holder_of(session, principal.team, name)
    for dep in list_deployments(session, principal):
        if dep.job_id != holder or model not in (None, dep.name):
            continue
        job = session.get(Job, dep.job_id)
        if job is not None and name in stored_spec(job.spec).lora_adapters:
            message = f"lora_name: {name!r} is one of the deployment's lora_adapters, set at submission"
            raise OpenAIError(400, message, "lora_name")
        if name == dep.name:
            raise OpenAIError(400, f"lora_name: {name!r} is the deployment itself", "lora_name")
        return dep, (live_adapters.loaded_adapters(session, job) if job is not None else {}).get(name)
    raise OpenAIError(404, f"lora_name: no adapter {name!r} is loaded (see GET /v1/models)", "lora_name", "not_found")


def _record(session: Session, dep: Deployment, name: str, path: str, loaded: bool) -> None:
    job = session.get(Job, dep.job_id)
    if job is not None:
        live_adapters.record(session, job, name, path, loaded)


async def _engine(request: Request, dep: Deployment, route: str, payload: dict[str, Any]) -> None:
    """POST ``payload`` to the deployment's engine; its refusal as an OpenAIError with the engine's field."""
    assert dep.url is not None  # a ready deployment
    client = _serving(request.app).proxy.client(dep.url)
    try:
        answer = await client.post(f"{dep.url}{route}", json=payload, timeout=ENGINE_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise OpenAIError(
            503, f"deployment {dep.name!r} is not answering; retry later", "model", "model_not_ready"
        ) from err
    if answer.status_code == 200:
        return
    try:
        error = answer.json()["error"]
        message, field = str(error["message"]), error.get("field")
    except (ValueError, KeyError, TypeError):
        message, field = f"the engine answered {answer.status_code}", None
    raise OpenAIError(answer.status_code, message, field, "not_found" if answer.status_code == 404 else None)
