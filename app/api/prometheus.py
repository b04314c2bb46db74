"""GET /metrics: the Prometheus text exposition (admins only; an unauthenticated listener of its own is the
``metrics_listen_port`` setting)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.api.deps import PrincipalDep
from core.errors import ApiError
from core.metrics_registry import CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={401: {"description": "No or bad token"}, 403: {"description": "Not an admin token"}},
)
async def prometheus_metrics(request: Request, principal: PrincipalDep) -> Response:
    """Operational metrics in Prometheus' text format: request latency, jobs by state, queue wait, leases, ingest
    lag, webhook deliveries, host heartbeats."""
    if not principal.admin:
        raise ApiError(403, "forbidden", "/metrics needs an admin token", "Authorization")
    body = await run_in_threadpool(request.app.state.metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE)
