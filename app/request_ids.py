"""Give every request an id (the caller's ``X-Request-ID`` if sane, else a new one), bind it to the request's log
records (``core.structured_logs``) and echo it in the answer; a job submitted by the request keeps it."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from app.asgi_headers import adding_headers
from app.http_middleware import HttpMiddleware
from core.structured_logs import accept_request_id, bound

HEADER = b"x-request-id"


class RequestIdMiddleware(HttpMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers") or []).get(HEADER)
        request_id = accept_request_id(given.decode("latin-1") if given else None)
        with bound(request_id=request_id):
            await self.app(scope, receive, adding_headers(send, {HEADER: request_id.encode()}))
