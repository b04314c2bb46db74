"""The base of the service's raw ASGI middlewares (request ids, security headers, input guard, body limits, body
timeouts, request metrics): each acts on HTTP requests only, and lifespan or websocket traffic passes through it
untouched. Raw ASGI rather than Starlette's ``BaseHTTPMiddleware``, which buffers streamed bodies (SSE, downloads).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMiddleware:
    """Wraps ``app``; ``handle`` sees each HTTP request, everything else goes straight to ``app``."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class StartWatch:
    """A ``send`` that remembers whether the response has started: an error found later can still be answered
    only while it has not."""

    def __init__(self, send: Send):
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)
