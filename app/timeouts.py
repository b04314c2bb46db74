"""Slow clients cannot hold the server: a request body that stalls is cut off (408, ``BodyTimeoutMiddleware``) and a
connection whose request head never completes is closed (``HeaderTimeoutProtocol``, uvicorn's HTTP protocol with a
timer uvicorn lacks: its keep-alive timeout only runs between requests)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.http_middleware import HttpMiddleware, StartWatch
from core.errors import ApiError, error_body


class BodyTimeout(ApiError):
    """Raised from ``receive`` when the next piece of the body does not come in time; the ApiError handler answers."""

    def __init__(self, seconds: float):
        super().__init__(408, "request_timeout", f"the request body stalled: nothing arrived for {seconds:g} s")


class BodyTimeoutMiddleware(HttpMiddleware):
    """Each read of the request body must return within ``seconds``; after the body, reads (a streaming response
    waiting for the client to go) are not timed."""

    def __init__(self, app: ASGIApp, seconds: float):
        super().__init__(app)
        self.seconds = seconds

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(self.seconds) as scope_:
                message = await receive()
            if scope_.cancelled_caught:
                raise BodyTimeout(self.seconds)
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        watch = StartWatch(send)
        try:
            await self.app(scope, timed_receive, watch)
        except BodyTimeout as err:  # raised where no exception handler answers (a middleware reading the body)
            if not watch.started:
                await JSONResponse(error_body(err.code, err.message), status_code=err.status)(scope, receive, send)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """Closes a connection whose request line and headers are not all in within ``header_timeout_s`` of the
    connection opening (first request) or of the request's first byte (later ones on a kept-alive connection)."""

    header_timeout_s = 10.0  # set by ``with_header_timeout``

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to give uvicorn (``http=``) with ``seconds`` as its header timeout."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})
