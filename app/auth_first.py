"""Authentication before anything else: a route that needs a token has it checked before any body is read.

FastAPI reads and validates a request body before it solves a route's dependencies, and ``app.input_guard`` parses
JSON bodies before any route runs; so with the token checked in a dependency, a client without one got 400/422 with
validation detail and made the API parse what it sent. ``AuthFirstMiddleware`` runs outside the body-reading
middlewares: it matches the request against the app's routes (in the router's order), answers 405 with an ``Allow``
listing every method of the path (Starlette's own 405 names only the first route's), and for a route that declares a
bearer security dependency (what the OpenAPI document lists as ``security``) authenticates the token off the event
loop and answers 401 (OpenAI's error shape on the OpenAI routes, MLflow's ``{"error_code": "UNAUTHENTICATED"}`` under
/api/2.0/mlflow/, so its client raises a clear error) without touching the body. The principal found is
left in ``request.state.principal`` for ``app.api.deps.get_principal``; on the OpenAI routes it is remembered a few
seconds (``app.lookup_cache``, which says how a revoke reaches it). A path no route matches passes on (404).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from fastapi.security.base import SecurityBase
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from app import lookup_cache
from app.errors import database_unavailable
from app.openai_format import OpenAIError
from core.auth import Principal, authenticate
from core.db import get_sessionmaker
from core.errors import error_body

MISSING_TOKEN = "missing bearer token (Authorization: Bearer <token>)"
BAD_TOKEN = "invalid or revoked token"
OPENAI_MISSING_TOKEN = "missing bearer token (the openai client's api_key: a team token)"
OPENAI_TAG = "openai"
MLFLOW_TAG = "mlflow"
BEARER_CHALLENGE = {"WWW-Authenticate": "Bearer"}  # RFC 9110: a 401 names the scheme it wants


@dataclass(frozen=True)
class RouteEntry:
    """One route as the middleware sees it: where it matches, its methods, whether it needs a token."""

    regex: re.Pattern[str]
    methods: frozenset[str]
    secured: bool
    openai: bool
    mlflow: bool = False


def _dependencies(dependant: Any) -> Iterator[Any]:
    for sub in getattr(dependant, "dependencies", ()):
        yield sub
        yield from _dependencies(sub)


def needs_token(route: Any) -> bool:
    """Whether a route declares a security scheme (``HTTPBearer``) among its dependencies, at any depth: the same
    declaration FastAPI turns into the operation's ``security`` in the OpenAPI document."""
    return any(isinstance(dep.call, SecurityBase) for dep in _dependencies(getattr(route, "dependant", None)))


def route_table(api: FastAPI) -> list[RouteEntry]:
    """The app's method routes in the router's order; mounts (static files) are left to themselves."""
    table = []
    for route in iter_route_contexts(api.routes):
        methods, regex = getattr(route, "methods", None), getattr(route, "path_regex", None)
        if methods and regex is not None:
            tags = getattr(route, "tags", None) or ()
            table.append(
                RouteEntry(regex, frozenset(methods), needs_token(route), OPENAI_TAG in tags, MLFLOW_TAG in tags)
            )
    return table


def bearer_token(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None (absent, another scheme, empty)."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


def _lookup(database_url: str, token: str) -> Principal | None:
    with get_sessionmaker(database_url)() as session:
        return authenticate(session, token)


def _unauthorized(entry: RouteEntry, missing: bool) -> JSONResponse:
    headers = BEARER_CHALLENGE
    message = MISSING_TOKEN if missing else BAD_TOKEN
    if entry.mlflow:  # MLflow's code for "who are you?" (its ErrorCode UNAUTHENTICATED, HTTP 401)
        return JSONResponse({"error_code": "UNAUTHENTICATED", "message": message}, status_code=401, headers=headers)
    if entry.openai:
        err = (
            OpenAIError(401, OPENAI_MISSING_TOKEN, None, "unauthorized")
            if missing
            else OpenAIError(401, BAD_TOKEN, None, "invalid_api_key")
        )
        return JSONResponse(err.body(), status_code=401, headers=headers)
    body = error_body("unauthorized", message, "Authorization")
    return JSONResponse(body, status_code=401, headers=headers)


def _not_allowed(allowed: set[str]) -> JSONResponse:
    allow = ", ".join(sorted(allowed))
    body = error_body("method_not_allowed", f"method not allowed here; allowed: {allow}")
    return JSONResponse(body, status_code=405, headers={"Allow": allow})


class AuthFirstMiddleware:
    """See the module docstring. ``api`` is the FastAPI app whose routes are matched (read at the first request,
    once every router is included)."""

    def __init__(self, app: ASGIApp, api: FastAPI, database_url: str):
        self.app, self.api, self.database_url = app, api, database_url
        self._table: list[RouteEntry] | None = None

    def _match(self, path: str, method: str) -> tuple[RouteEntry | None, set[str]]:
        """The route that will handle the request (first full match), and every method the path allows."""
        if self._table is None:
            self._table = route_table(self.api)
        allowed: set[str] = set()
        for entry in self._table:
            if entry.regex.match(path):
                if method in entry.methods:
                    return entry, allowed
                allowed |= entry.methods
        return None, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        entry, allowed = self._match(path[len(root) :] if root and path.startswith(root) else path, scope["method"])
        if entry is None and allowed:
            await _not_allowed(allowed)(scope, receive, send)
            return
        if entry is not None and entry.secured:
            answer = await self._authenticate(scope, entry)
            if answer is not None:
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _authenticate(self, scope: Scope, entry: RouteEntry) -> JSONResponse | None:
        """None when the token is good (the principal stored in the request's state); otherwise the answer."""
        token = bearer_token(scope)
        if token is None:
            return _unauthorized(entry, missing=True)
        try:
            principal = await self._principal(token, entry)
        except (OperationalError, InterfaceError, PoolTimeout):
            return database_unavailable()  # retryable, as app.errors answers it on any route
        if principal is None:
            return _unauthorized(entry, missing=False)
        scope.setdefault("state", {})["principal"] = principal
        return None

    async def _principal(self, token: str, entry: RouteEntry) -> Principal | None:
        """The token's principal; on the OpenAI routes remembered a few seconds (``app.lookup_cache``: their hot
        path, where a revoke by another process takes up to ``TTL_S``)."""
        if not entry.openai:
            return await anyio.to_thread.run_sync(_lookup, self.database_url, token)
        key = lookup_cache.principal_key(self.database_url, token)
        found, _ = await lookup_cache.PRINCIPALS.remembered(key, lambda: _lookup(self.database_url, token))
        return found
