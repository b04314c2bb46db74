"""Time every HTTP request into the process's Prometheus histogram, labelled by route template (``/v1/jobs/{job_id}``,
never the raw path, so ids do not explode the label set), method and status."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http_middleware import HttpMiddleware
from core.metrics_registry import ServiceMetrics


class RequestMetricsMiddleware(HttpMiddleware):
    def __init__(self, app: ASGIApp, metrics: ServiceMetrics):
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started, status = time.perf_counter(), 500

        async def remember(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, remember)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe_request(scope["method"], route, status, time.perf_counter() - started)
