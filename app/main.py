"""The FastAPI application: routers, middleware, error format, OpenAPI with every job kind; starts the core's loops."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import start_http_server
from pydantic import TypeAdapter

from app.api import (
    downloads,
    files,
    health,
    hosts,
    jobs,
    mlflow,
    observe,
    openai_compat,
    prometheus,
    sweeps,
    team_settings,
    webhooks,
)
from app.api_docs import document_refusals, install_docs
from app.auth_first import AuthFirstMiddleware
from app.errors import install_error_handlers
from app.input_guard import InputGuardMiddleware
from app.limits import BodyLimitMiddleware
from app.openai_adapters import router as lora_adapters_router
from app.request_ids import RequestIdMiddleware
from app.request_metrics import RequestMetricsMiddleware
from app.security_headers import SecurityHeadersMiddleware
from app.team_slots import TeamSlots
from app.timeouts import BodyTimeoutMiddleware
from core import secrets_box
from core.background_loops import start_loops
from core.db import upgrade_head
from core.dispatch import Dispatcher
from core.metrics_registry import ServiceMetrics
from core.settings import Settings, get_settings
from engine.contract.spec import JobSpec

log = logging.getLogger(__name__)
UI_DIR = Path(__file__).parent / "ui"


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated document plus the JobSpec union (one schema per kind) as the POST /v1/jobs body."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    spec_schema = TypeAdapter(JobSpec).json_schema(ref_template="#/components/schemas/{model}", mode="validation")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(spec_schema.pop("$defs", {}))
    components["JobSpec"] = spec_schema
    app.openapi_schema = document_refusals(schema)
    return schema


def create_app(settings: Settings | None = None, *, migrate: bool = True, reconcile: bool = True) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.ensure_dirs()
        if migrate:
            await anyio.to_thread.run_sync(upgrade_head, settings.database_url, secrets_box.keys(settings))
        loops = start_loops(settings, run=reconcile)  # the leader-only passes (core.background_loops)
        dispatching = app.state.dispatcher.start()  # submissions' scheduling, off the request
        listener = (
            start_http_server(
                settings.metrics_listen_port, settings.metrics_listen_host, registry=app.state.metrics.registry
            )
            if settings.metrics_listen_port
            else None
        )
        yield
        if listener is not None:
            listener[0].shutdown()
        dispatching.cancel()
        await loops.stop()

    app = FastAPI(
        title="llmjobs",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        description="Submit, watch and cancel Qwen3 preprocess / train / convert / eval jobs.",
    )
    app.state.settings = settings
    app.state.dispatcher = Dispatcher(settings)
    app.state.metrics = ServiceMetrics(settings.database_url)
    app.state.streams = TeamSlots("job streams", settings.team_max_streams, settings.team_limit_retry_after_s)
    app.state.uploads = TeamSlots("uploads", settings.team_max_uploads, settings.team_limit_retry_after_s)
    install_error_handlers(app)
    app.add_middleware(InputGuardMiddleware)  # inside the body limit: it reads bodies already capped
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_body_bytes, upload_max_bytes=settings.upload_max_bytes
    )
    app.add_middleware(BodyTimeoutMiddleware, seconds=settings.body_read_timeout_s)  # a stalled body is cut off
    # Outside every middleware that reads or limits a body: a caller without a valid token learns nothing about its
    # body (no 400/413/422), and 405s carry the path's full Allow (app.auth_first).
    app.add_middleware(AuthFirstMiddleware, api=app, database_url=settings.database_url)
    app.add_middleware(SecurityHeadersMiddleware)  # every answer gets the headers
    app.add_middleware(RequestIdMiddleware)  # X-Request-ID bound to the request's logs and its jobs
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics)  # outermost: times every request
    for router in (
        health.router,
        jobs.router,
        observe.router,
        observe.latest_router,
        hosts.router,
        webhooks.router,
        mlflow.router,  # MLflow's tracking API (a notebook's mlflow client)
        sweeps.router,  # hyperparameter sweeps (core.sweeps)
        team_settings.secrets_router,  # a team's sealed secrets (core.team_secrets)
        team_settings.teams_router,  # a team's report_to default (core.tracking)
        prometheus.router,
        downloads.router,
        files.router,
        openai_compat.router,
        openai_compat.root_router,
        lora_adapters_router,
    ):
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    install_docs(app)  # /docs and /redoc from local files (app.api_docs)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(UI_DIR / "index.html")

    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")  # the dashboard's modules, styles and vendored uPlot

    return app
