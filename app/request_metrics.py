"""Time every HTTP request into the process's Prometheus histogram, labelled by route template (``/v1/jobs/{job_id}``,
never the raw path, so ids do not explode the label set), method and status."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.metrics_registry import ServiceMetrics


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
