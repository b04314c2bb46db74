"""Refuse request bodies over ``max_body_bytes`` with 413, whether or not the client sent Content-Length.

File uploads (``PUT /v1/files/{path}``, streamed to disk by ``app.api.files``) have their own, larger limit."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http_middleware import HttpMiddleware, StartWatch
from core.errors import ApiError, error_body


class BodyTooLarge(ApiError):
    """Raised from ``receive`` while the app reads the body; the ApiError handler answers 413."""

    def __init__(self, max_bytes: int):
        super().__init__(413, "payload_too_large", f"request body is larger than {max_bytes} bytes")


UPLOAD_PREFIX = "/v1/files/"


def is_upload(scope: Scope) -> bool:
    """A file upload: its body is streamed to disk by the route, never read whole by a middleware."""
    return scope.get("method") == "PUT" and str(scope.get("path", "")).startswith(UPLOAD_PREFIX)


class BodyLimitMiddleware(HttpMiddleware):
    def __init__(self, app: ASGIApp, max_bytes: int, upload_max_bytes: int | None = None):
        super().__init__(app)
        self.default_max, self.upload_max = max_bytes, upload_max_bytes or max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        max_bytes = self.upload_max if is_upload(scope) else self.default_max
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await self._refuse(send, max_bytes)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge(max_bytes)
            return message

        watch = StartWatch(send)
        try:
            await self.app(scope, limited_receive, watch)
        except BodyTooLarge:
            if not watch.started:
                await self._refuse(send, max_bytes)

    async def _refuse(self, send: Send, max_bytes: int) -> None:
        body: dict[str, Any] = error_body("payload_too_large", f"request body is larger than {max_bytes} bytes")
        raw = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": raw})
