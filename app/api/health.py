"""Liveness and readiness probes (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import SessionDep
from app.schemas import Health
from core.db import ping

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
def readyz(session: SessionDep) -> Health | JSONResponse:
    """The database answers."""
    try:
        ping(session)
    except Exception as err:  # noqa: BLE001 - report, don't crash the probe
        return JSONResponse(Health(status="unavailable", checks={"database": str(err)}).model_dump(), status_code=503)
    return Health(status="ok", checks={"database": "ok"})
