"""Sweeps: submit a hyperparameter search over a train spec (its trials are train jobs), follow it, cancel it
(``core.sweeps``). Left out of the OpenAPI document for now: the body is read raw and checked by ``core.sweep_spec``
(a schema-valid base spec is not always a valid train spec)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from core import paths, sweeps, tracking
from core.auth import load_visible
from core.errors import ApiError
from core.models import Sweep
from core.sweep_spec import parse_sweep

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"], include_in_schema=False)


@router.post("", status_code=201)
async def create_sweep(
    request: Request, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> dict[str, Any]:
    """Check the sweep (space fields, the base spec at the space's corners), store it and start its first trials."""
    try:
        raw = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {err}", None) from err
    areas = paths.ensure_team_areas(settings, principal.team)
    spec = parse_sweep(raw, dict(areas.context()))
    await run_in_threadpool(tracking.check_sweep_base, session, settings, principal.team, spec.base)
    sweep = Sweep(team=principal.team, name=spec.name, spec=spec.model_dump(mode="json"), trial_attrs={}, pruned=[])
    session.add(sweep)
    session.commit()
    await run_in_threadpool(sweeps.drive, settings, sweep.id, False)
    request.app.state.dispatcher.wake()  # the first trials are queued jobs: the Dispatcher sends them
    session.expire_all()
    return await run_in_threadpool(sweeps.view, session, load_visible(session, Sweep, sweep.id, principal, "sweep"))


@router.get("")
def list_sweeps(session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    rows = sweeps.team_sweeps(session, principal.team)
    data = [{"id": s.id, "name": s.name, "state": s.state, "result": s.result} for s in rows]
    return {"data": data, "has_more": False}


@router.get("/{sweep_id}")
def get_sweep(sweep_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    return sweeps.view(session, load_visible(session, Sweep, sweep_id, principal, "sweep"))


@router.post("/{sweep_id}/cancel")
def cancel_sweep(sweep_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    sweep = load_visible(session, Sweep, sweep_id, principal, "sweep")
    sweeps.cancel(session, sweep)
    return sweeps.view(session, sweep)
