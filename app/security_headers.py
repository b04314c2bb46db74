"""Security headers on every response: a strict Content-Security-Policy, nosniff, no referrer, no framing.

The dashboard and the API docs load only same-origin files (no inline script anywhere), so ``script-src 'self'``
holds everywhere, and Swagger UI (/docs) runs under the strict policy as is. ReDoc's styled-components add
``<style>`` elements and its search runs in a ``blob:`` worker, so /redoc alone (``DOCS_PATHS``) also allows inline
styles and blob workers; its scripts stay same-origin (its "powered by" logo from a CDN is blocked, on purpose).
A pure ASGI middleware, outermost, so error answers of the other middlewares (413, refused input) carry them too.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from app.asgi_headers import adding_headers
from app.http_middleware import HttpMiddleware

_BASE = (
    "default-src 'self'; script-src 'self'; img-src 'self' data:; font-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
STRICT_CSP = f"{_BASE}; style-src 'self'"
DOCS_CSP = f"{_BASE}; style-src 'self' 'unsafe-inline'; worker-src 'self' blob:"
DOCS_PATHS = ("/redoc",)
HEADERS = {
    b"x-content-type-options": b"nosniff",
    b"referrer-policy": b"no-referrer",
    b"x-frame-options": b"DENY",  # for browsers that predate frame-ancestors
    b"cross-origin-opener-policy": b"same-origin",
}


def csp_for(path: str) -> str:
    return DOCS_CSP if path in DOCS_PATHS else STRICT_CSP


class SecurityHeadersMiddleware(HttpMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        extra = {b"content-security-policy": csp_for(scope.get("path", "")).encode(), **HEADERS}
        await self.app(scope, receive, adding_headers(send, extra))
