"""Add headers to an ASGI answer: the one ``send`` wrapper the header middlewares (request id, security headers)
share. Kept as raw ASGI rather than Starlette's ``BaseHTTPMiddleware``, which buffers streamed bodies (SSE, downloads).
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import Message, Send


def adding_headers(send: Send, headers: Mapping[bytes, bytes]) -> Send:
    """``send`` with ``headers`` appended to the response start, each unless the answer already set it."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            present = {name.lower() for name, _ in message.get("headers", [])}
            message["headers"] = [
                *message.get("headers", []),
                *((k, v) for k, v in headers.items() if k not in present),
            ]
        await send(message)

    return wrapped
